"""A persistent pool of ``torch.distributed`` worker processes for tests.

Spawning processes and a gloo process group for every distributed test costs
many seconds. :class:`WorkerPool` instead starts ``world_size`` workers once,
through a multiprocessing *forkserver* with ``torch`` preloaded, and keeps them
for a whole test session. Design:

* Each worker joins a gloo WORLD group over a TCP rendezvous on a free local
  port, then creates (collectively, in the same order on every worker) one
  subgroup per entry of :data:`GROUP_RANKS`. A task over ranks ``(0, 1, 2, 3)``
  gets a dedicated subgroup, never WORLD, so code that silently falls back to
  WORLD is caught.
* :meth:`WorkerPool.run` pickles ``(fn, args, kwargs)`` *by reference* with the
  standard :mod:`pickle` (so ``fn`` must be a module-level function) and sends
  it to the workers of the chosen group, together with the parent's
  ``sys.path`` so that test modules can be imported. Each worker calls
  ``fn(ctx, *args, **kwargs)`` with a :class:`RankContext`, after
  ``torch.manual_seed(0)`` and inside ``warnings.catch_warnings()``, e.g.
  ``pool.run(_check_sum, 3, world_size=2)`` runs ``_check_sum(ctx, 3)``.
* Results come back as ``pickle.dumps`` bytes on a plain multiprocessing queue,
  which keeps torch's shared-memory tensor reductions (and fd passing) out.
  An ``OSS`` in a result (it refuses to be pickled, :mod:`oss_plus.state.copies`) comes
  back as a string naming its class.
* Failures are handled fast: an exception on any rank raises
  :class:`RemoteError` with the remote tracebacks, a missing answer raises
  :class:`PoolTimeout`, and a dead worker is noticed by polling its exit code.
  After any failure all workers are killed (peers may be stuck inside a
  collective) and fresh ones are started lazily by the next :meth:`run`.
* Workers are daemonic, a watchdog thread in each makes it exit within a
  second when the pool's process dies (even mid-collective), and
  :meth:`WorkerPool.close` is registered with :mod:`atexit`.
"""

from __future__ import annotations

import atexit
import io
import logging
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime.launch import free_port, init_local_group
from oss_plus.state.copies import refuse_reduce

__all__ = ["GROUP_RANKS", "PoolError", "PoolTimeout", "RankContext", "RemoteError", "WorkerPool"]

logger = logging.getLogger(__name__)

Ranks = tuple[int, ...]

#: Subgroups created in every worker, in this order (a collective over WORLD).
GROUP_RANKS: tuple[Ranks, ...] = ((0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 3), (1, 2, 3))

_POLL_S = 0.05  # how often the parent checks worker liveness while waiting
_ERROR_GRACE_S = 0.5  # after a first error, how long to wait for other ranks


class PoolError(RuntimeError):
    """Base class of the errors raised by :class:`WorkerPool` (also: it failed to start)."""


class RemoteError(PoolError):
    """One or more ranks raised an exception or died while running a task.

    Attributes:
        failures: Maps the global rank of each failing worker to its traceback
            text (or a description of how it died).
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class PoolTimeout(PoolError):
    """Not every rank answered within the timeout.

    Attributes:
        missing: Global ranks that did not answer.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class RankContext:
    """What a task function receives as its first argument on each rank.

    Attributes:
        group: Process group of the ranks running the task.
        rank: Rank of this worker within ``group``.
        world_size: Size of ``group``.
        global_rank: Rank of this worker in WORLD.
        groups: Every group of :data:`GROUP_RANKS` that this worker belongs to,
            keyed by the tuple of its global ranks.
        device: Device to put tensors on (always CPU here).
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    global_rank: int
    groups: dict[Ranks, dist.ProcessGroup] = field(repr=False)
    device: torch.device = torch.device("cpu")


def _watch_parent() -> None:
    """Ends this worker as soon as its parent (or the forkserver) is gone."""
    ppid, parent = os.getppid(), mp.parent_process()
    while os.getppid() == ppid and (parent is None or parent.is_alive()):
        time.sleep(0.5)
    os._exit(1)


def _describe_exit(code: int) -> str:
    """Describes a process exit code, naming the signal for negative codes."""
    signals = {-s.value: s.name for s in signal.Signals}
    return f"exit code {code}" + (f" (killed by {signals[code]})" if code in signals else "")


def _run_task(message: Any, global_rank: int, groups: dict[Ranks, dist.ProcessGroup]) -> Any:
    """Unpickles and runs one task message on this worker; returns what the task returned."""
    _, ranks, sys_path, payload = message
    sys.path.extend(p for p in sys_path if p not in sys.path)
    fn, args, kwargs = pickle.loads(payload)
    ctx = RankContext(groups[ranks], ranks.index(global_rank), len(ranks), global_rank, groups)
    torch.manual_seed(0)
    random.seed(0)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        with warnings.catch_warnings():
            return fn(ctx, *args, **kwargs)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


def _worker_main(
    global_rank: int, world_size: int, port: int, pg_timeout_s: float, tasks: Any, results: Any
) -> None:
    """Entry point of a worker process: joins the groups, then serves tasks.

    Args:
        global_rank: Rank of this worker in WORLD.
        world_size: Number of workers.
        port: TCP port of the rendezvous store (hosted by rank 0).
        pg_timeout_s: Timeout of every process group, in seconds.
        tasks: Queue of ``(task_id, ranks, sys_path, payload)`` messages; ``None`` stops.
        results: Queue of pickled ``(task_id, rank, ok, data)`` tuples, where ``data``
            is the pickled return value if ``ok`` else the traceback text.
    """
    threading.Thread(target=_watch_parent, name="parent-watchdog", daemon=True).start()
    timeout = timedelta(seconds=pg_timeout_s)
    try:
        torch.set_num_threads(1)
        init_local_group(global_rank, world_size, port, timeout_s=pg_timeout_s)
        groups: dict[Ranks, dist.ProcessGroup] = {}
        for ranks in (r for r in GROUP_RANKS if max(r) < world_size):
            group = dist.new_group(list(ranks), timeout=timeout)
            if global_rank in ranks:
                groups[ranks] = group
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(pickle.dumps((-1, global_rank, False, traceback.format_exc())))
        return
    results.put(pickle.dumps((-1, global_rank, True, None)))
    while (message := tasks.get()) is not None:
        task_id = message[0]
        reply: tuple[int, int, bool, bytes | str]
        try:
            data = _dumps(_run_task(message, global_rank, groups))
            reply = (task_id, global_rank, True, data)
        except BaseException:  # noqa: BLE001 - reported to the parent
            reply = (task_id, global_rank, False, traceback.format_exc())
        results.put(pickle.dumps(reply))
    dist.destroy_process_group()


class _ResultPickler(pickle.Pickler):
    """Pickles a task's result; an ``OSS`` in it (which refuses to be pickled:
    :mod:`oss_plus.state.copies`) comes back as a string naming its class."""

    def reducer_override(self, obj: Any) -> Any:
        if getattr(type(obj), "__reduce_ex__", None) is refuse_reduce:
            return str, (f"<{type(obj).__name__} object>",)
        return NotImplemented


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer).dump(value)
    return buffer.getvalue()


class WorkerPool:
    """A persistent pool of gloo-connected worker processes.

    Args:
        world_size: Number of workers (the groups of :data:`GROUP_RANKS` need 4).
        pg_timeout_s: Timeout, in seconds, of WORLD and of every subgroup.
        startup_timeout_s: How long to wait for all workers to join.
    """

    def __init__(
        self, world_size: int = 4, pg_timeout_s: float = 30.0, startup_timeout_s: float = 60.0
    ) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any | None = None
        self._task_id = 0
        self._closed = False
        atexit.register(self.close)
        self._start()

    @property
    def groups(self) -> tuple[Ranks, ...]:
        """The rank tuples that :meth:`run` accepts as ``ranks``."""
        return tuple(r for r in GROUP_RANKS if max(r) < self.world_size)

    def _start(self, attempts: int = 3) -> None:
        """Starts all workers, retrying with a new port if the rendezvous fails."""
        for attempt in range(1, attempts + 1):
            begin = time.monotonic()
            port = free_port()
            self._results = self._ctx.Queue()
            self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
            spec = (self.world_size, port, self.pg_timeout_s)
            self._procs = []
            for rank, tasks in enumerate(self._tasks):
                args = (rank, *spec, tasks, self._results)
                name = f"oss_plus-worker-{rank}"
                self._procs.append(self._ctx.Process(target=_worker_main, args=args, name=name))
                self._procs[-1].daemon = True
                self._procs[-1].start()
            try:
                self._collect(-1, tuple(range(self.world_size)), self.startup_timeout_s)
            except PoolError as exc:
                self._kill()
                logger.warning("pool start attempt %d (port %d) failed: %s", attempt, port, exc)
                if attempt == attempts:
                    raise PoolError(f"pool failed to start {attempts} times: {exc}") from exc
                continue
            logger.info("pool of %d started in %.2fs", self.world_size, time.monotonic() - begin)
            return

    def _kill(self) -> None:
        """Kills every worker at once and drops the queues."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)
        for q in [*self._tasks, self._results] if self._results is not None else []:
            q.cancel_join_thread()
            q.close()
        self._procs, self._tasks, self._results = [], [], None

    def _collect(self, task_id: int, ranks: Ranks, timeout: float) -> dict[int, Any]:
        """Waits for the replies of ``ranks`` to ``task_id``; returns them keyed by global rank.

        Raises:
            RemoteError: A rank raised or died.
            PoolTimeout: A rank did not answer within ``timeout`` seconds.
        """
        assert self._results is not None
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(values) + len(failures) < len(ranks):
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                raw = self._results.get(timeout=min(_POLL_S, deadline - now))
            except queue.Empty:
                for rank in ranks:
                    code = self._procs[rank].exitcode
                    if code is not None and rank not in values and rank not in failures:
                        failures[rank] = f"worker process died with {_describe_exit(code)}"
                        deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
                continue
            reply_id, rank, ok, data = pickle.loads(raw)
            if reply_id != task_id:
                logger.debug("dropping stale reply to task %d from rank %d", reply_id, rank)
                continue
            if ok:
                try:
                    values[rank] = pickle.loads(data) if data is not None else None
                    continue
                except Exception:  # noqa: BLE001 - reported like a remote failure
                    data = "result could not be unpickled in the parent:\n" + traceback.format_exc()
            failures[rank] = data
            deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        missing = [r for r in ranks if r not in values and r not in failures]
        if failures:
            text = "\n".join(
                f"--- rank {ranks.index(r)} (global rank {r}) failed:\n{failures[r]}"
                for r in sorted(failures)
            )
            if missing:
                text += f"\n--- global ranks {missing} did not answer (stuck on the failure?)"
            msg = f"task failed on {len(failures)} of {len(ranks)} ranks\n{text}"
            raise RemoteError(msg, failures)
        if missing:
            local = [ranks.index(r) for r in missing]
            raise PoolTimeout(
                f"ranks {local} (global ranks {missing}) of group {ranks} did not "
                f"answer within {timeout:.1f}s",
                missing,
            )
        return values

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int = 2,
        ranks: Ranks | None = None,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Runs ``fn(ctx, *args, **kwargs)`` on every rank of a group.

        Args:
            fn: A module-level function taking a :class:`RankContext` first.
            *args: Positional arguments for ``fn`` (picklable).
            world_size: Run on global ranks ``0 .. world_size - 1``.
            ranks: Global ranks of the group to run on; overrides ``world_size``.
            timeout: Seconds to wait for every rank to answer.
            **kwargs: Keyword arguments for ``fn`` (picklable).

        Returns:
            The return values of ``fn``, ordered by rank within the group.

        Raises:
            ValueError: ``ranks`` / ``world_size`` does not name a known group.
            RemoteError: A rank raised or its process died.
            PoolTimeout: A rank did not answer within ``timeout``.
        """
        if self._closed:
            raise PoolError("the worker pool is closed")
        group = tuple(ranks) if ranks is not None else tuple(range(world_size))
        if group not in self.groups:
            raise ValueError(f"no group over ranks {group}; known groups: {self.groups}")
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # pickle raises several types (PicklingError, AttributeError, ...)
            raise TypeError(f"cannot pickle {fn!r} (use a module-level function): {exc}") from exc
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self._kill()
            self._start()
        self._task_id += 1
        sys_path = [os.path.abspath(p) for p in sys.path]
        for rank in group:
            self._tasks[rank].put((self._task_id, group, sys_path, payload))
        try:
            values = self._collect(self._task_id, group, timeout)
        except PoolError:
            logger.info("task %s failed: killing all workers (restarted by next run)", fn.__name__)
            self._kill()
            raise
        return [values[rank] for rank in group]

    def close(self) -> None:
        """Stops all workers; the pool cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
