"""Asynchronous saves: snapshot into reusable staging buffers, write in a background thread.

``save_checkpoint(..., blocking=False)`` plans the save on the caller's thread (one collective
phase over the optimizer's group, as a blocking save does) with the rank's state copied
into staging buffers, then runs the rest of the save (writes, the metadata gather, the
commit, the removal of the replaced files) in a background thread over a **process group
made for checkpoints** (gloo, the same ranks as the optimizer's group, created once at the
first asynchronous save). So the writer's collectives never interleave with the training's
on its group: they cannot reorder or deadlock them, and the commit does not wait for the
caller to come back. At most one save per optimizer is in flight: the next save (blocking
or not) waits for it, and raises :data:`PREVIOUS_SAVE_FAILED` if it failed.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.checkpoint.format import PlainValue
from oss_plus.checkpoint.plan import Entries, Slot, replace_slots, tensor_slots

__all__ = ["PREVIOUS_SAVE_FAILED", "Saver", "checkpoint_group", "saver_of", "staging_nbytes"]

logger = logging.getLogger(__name__)

#: Raised by the save after an asynchronous save that failed (on every rank).
PREVIOUS_SAVE_FAILED = (
    "the previous asynchronous save_checkpoint to {path} failed ({kind}: {error}); that "
    "checkpoint was not written and the one before it is whole. This save did not start: "
    "fix the cause and call save_checkpoint again"
)
#: Timeout of the checkpoint process group (a peer that died fails the save after it).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)

#: Logged when this torch cannot be told the checkpoint group's name.
NO_GROUP_NAMING = (
    "this torch has no distributed_c10d._process_group_name: the checkpoint group of an "
    "asynchronous save takes torch's own name, which differs between ranks that made "
    "different numbers of process groups (the group's creation then times out)"
)

#: Niceness of the background writer thread (0-19; higher yields more CPU to training).
WRITER_NICENESS = 10

#: The checkpoint group of each set of global ranks, with the default group it was made in.
_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}
#: How many checkpoint groups this process made for each set of global ranks.
_MADE: dict[tuple[int, ...], int] = {}
#: Serializes the naming of checkpoint groups (see :func:`checkpoint_group`).
_NAMING = threading.Lock()
_SAVERS: weakref.WeakKeyDictionary[Any, Saver] = weakref.WeakKeyDictionary()
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


class Staging:
    """Reusable CPU copies of one rank's state tensors (pinned when the state is on GPU).

    A buffer is kept per tensor slot (flat index, key, position inside a container value)
    and reused while its shape and dtype stay the same; buffers of state this rank no longer
    holds are dropped. So the staging memory is one copy of this rank's shard of state,
    allocated once.
    """

    def __init__(self) -> None:
        self._buffers: dict[Slot, torch.Tensor] = {}

    def copy(self, entries: Entries) -> Entries:
        """Return ``entries`` with every tensor copied into its staging buffer."""
        buffers: dict[Slot, torch.Tensor] = {}
        on_gpu = False
        for slot, _, value in tensor_slots(entries):
            buffer = self._buffers.get(slot)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            on_gpu = on_gpu or value.is_cuda
            buffers[slot] = buffer
        if on_gpu:
            torch.cuda.synchronize()
        self._buffers = buffers
        plain = {
            i: {
                k: PlainValue(copy.deepcopy(v.value)) if isinstance(v, PlainValue) else v
                for k, v in entry.items()
            }
            for i, entry in entries.items()
        }
        return replace_slots(plain, buffers)

    def buffers(self) -> dict[Slot, torch.Tensor]:
        """The staging buffers by tensor slot (a new dict; the same tensors)."""
        return dict(self._buffers)

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class Saver:
    """Per optimizer: the staging buffers, the checkpoint process group, the save in flight."""

    def __init__(self, group: Any) -> None:
        self._parent = group
        self.staging = Staging()
        self._future: Future[str] | None = None
        self._failure: tuple[Path, BaseException] | None = None

    @property
    def group(self) -> Any:
        """The gloo group over the optimizer group's ranks (see :func:`checkpoint_group`)."""
        return checkpoint_group(tuple(dist.get_process_group_ranks(self._parent)))

    def settle(self) -> None:
        """Wait for the save in flight; raise :data:`PREVIOUS_SAVE_FAILED` if it failed."""
        if self._future is not None:
            self._future.exception()  # waits; the error is kept in _failure
            self._future = None
        if self._failure is not None:
            (path, error), self._failure = self._failure, None
            message = PREVIOUS_SAVE_FAILED.format(path=path, kind=type(error).__name__, error=error)
            raise RuntimeError(message) from error

    def submit(self, job: Callable[[], None], path: Path) -> Future[str]:
        """Run ``job`` (the rest of a planned save) in a background thread."""
        future: Future[str] = Future()
        future.set_running_or_notify_cancel()

        def run() -> None:
            _lower_priority()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - delivered by the future
                self._failure = (path, exc)
                future.set_exception(exc)
            else:
                future.set_result(str(path))

        thread = threading.Thread(target=run, name="oss_plus-async-save", daemon=True)
        self._future = future
        _THREADS.add(thread)
        thread.start()
        return future


def checkpoint_group(ranks: tuple[int, ...]) -> Any:
    """Return the gloo group the writer threads of ``ranks`` use (made on first use).

    Only the ranks of an optimizer's group save, so the group is made with
    ``use_local_synchronization=True``. torch then names it after the number of process
    groups the rank knows (a hash of the ranks and ``len(pg_names)``), and the members meet
    in the store under that name: ranks that made different numbers of groups before (a
    rank in two optimizer groups that both save asynchronously, or in a subgroup the others
    are not in) would wait for each other under different names until the timeout. So the
    name is chosen here, the same on every member whatever groups it made: the ranks and
    how many checkpoint groups this process made for them before (more than one only after
    the default group was made again).

    .. warning:: Collective: call on every rank of ``ranks`` (the first time).
    """
    world = dist.group.WORLD
    cached = _GROUPS.get(ranks)
    if cached is not None and cached[0] is world:
        return cached[1]
    made = _MADE.get(ranks, 0)
    name = "oss_plus_checkpoint_" + "_".join(map(str, ranks)) + f"_{made}"
    with _NAMING, _group_named(name):
        group = dist.new_group(
            list(ranks), timeout=GROUP_TIMEOUT, backend="gloo", use_local_synchronization=True
        )
    _GROUPS[ranks], _MADE[ranks] = (world, group), made + 1
    return group


@contextlib.contextmanager
def _group_named(name: str) -> Iterator[None]:
    """Inside the block, the next process group torch makes is named ``name``.

    torch has no public way to name a group: this replaces the function ``new_group`` asks
    for the name (``torch.distributed.distributed_c10d._process_group_name``). Without it
    (another torch), torch's own name is used and the limitation above remains.
    """
    c10d = dist.distributed_c10d
    torchs = getattr(c10d, "_process_group_name", None)
    if torchs is None:
        logger.warning(NO_GROUP_NAMING)
        yield
        return

    def named(ranks: Any, use_hashed_name: Any) -> Any:
        return name

    c10d._process_group_name = named
    try:
        yield
    finally:
        c10d._process_group_name = torchs


def _lower_priority() -> None:
    """Give the calling thread the niceness :data:`WRITER_NICENESS` (Linux: per thread).

    The writer then takes only the CPU the training's threads leave: the save finishes a
    little later, the training steps run closer to their quiet speed. Elsewhere a no-op.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, max(WRITER_NICENESS, os.getpriority(os.PRIO_PROCESS, tid))
        )
    except (AttributeError, OSError):  # no setpriority (Windows) or not permitted
        logger.debug("could not lower the priority of the checkpoint writer thread")


def saver_of(optimizer: Any) -> Saver:
    """Return the :class:`Saver` of ``optimizer`` (made on first use; not collective)."""
    saver = _SAVERS.get(optimizer)
    if saver is None:
        saver = _SAVERS[optimizer] = Saver(optimizer.group)
    return saver


def staging_nbytes(optimizer: Any) -> int:
    """Return the bytes of staging memory the asynchronous saves of ``optimizer`` hold.

    At most one copy of this rank's shard of optimizer state; 0 before the first
    asynchronous save.
    """
    saver = _SAVERS.get(optimizer)
    return 0 if saver is None else saver.staging.nbytes


@atexit.register
def _finish_saves_in_flight() -> None:
    """At interpreter exit, let the saves in flight commit (their peers are still there)."""
    for thread in list(_THREADS):
        if thread.is_alive():
            logger.info("waiting for an asynchronous checkpoint save to finish")
            thread.join()
