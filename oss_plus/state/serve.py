"""Each rank serves its shard of the optimizer state to a rank that reads the whole state alone.

A framework may call ``state_dict()`` (or ``consolidate_state_dict()``) on one rank only, or on
every rank with no consolidation first (issue 56). The caller then reads every other rank's
shard without those ranks making any call: each process runs one **server thread** that
waits, blocked in the default process group's key-value store (no CPU while idle), for
requests in its mailbox, and answers them from the optimizers it holds.

* **Mailbox.** A caller takes a ticket (``add`` on ``oss_plus/serve/<global rank>/n``) and
  posts its request as JSON under ``oss_plus/serve/<global rank>/<ticket>``; the server reads
  the tickets in order. The request names the optimizer (an id every rank of its group gives
  the same optimizer: the key of its construction's arrival check), the caller's version of
  the shard, and a fingerprint of the plan (a request for another optimizer is refused, never
  answered with the wrong shard).
* **Data.** The reply travels through the same store, never pickled: a JSON head (the step count
  the shard is at, the digests of the values one state dict keeps once, the JSON skeleton,
  dtypes and shapes of every state: :mod:`oss_plus.state.nested`), then the tensors' bytes in
  chunks of :data:`CHUNK_BYTES`, at most :data:`WINDOW` chunks ahead of the caller (so the store
  holds at most ``WINDOW * CHUNK_BYTES`` per transfer). Host memory only: state on a GPU is
  copied to the host tensor by tensor; the training's process group (NCCL or gloo) is never used.
* **Consistency.** The server reads the shard under the optimizer's step lock (held by
  ``step()`` around its local step only, not during the sync), as of the caller's version
  (:mod:`oss_plus.state.serving`); a shard at another step is refused.
* **Threads and connections.** The server and the callers of a process each use their own
  connection to the store (``Store.clone()``, torch >= 2.8; a new ``TCPStore`` client to the
  same host and port before), so a blocked wait never holds the training's connection.
* **Exit.** At interpreter exit (``atexit``) a process waits, at most the arrival timeout,
  until every process that serves exits too (counters in the store), serving reads meanwhile:
  a framework may save on one rank while the others end (the HF Trainer's last checkpoint).
  It then posts a stop to its own mailbox and joins the thread. A store whose server is gone
  (``destroy_process_group`` on the rank hosting it, where torchrun's agent does not host it)
  ends the thread too: TCPStore logs a warning then, nothing aborts. The thread is a daemon,
  so an exit never waits on it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime import positions
from oss_plus.runtime.arrival import arrival_timeout

__all__ = ["CHUNK_BYTES", "PREFIX", "WINDOW", "Service", "service", "shard_chunks"]

logger = logging.getLogger(__name__)

#: Where the mailboxes and replies live in the default store.
PREFIX = "oss_plus/serve"
#: Bytes per chunk of a reply. The allocator keeps a few freed chunks' worth of buffers (the
#: bytes the store's client returns): with 2 MiB chunks a read on every rank held 10-14 MiB
#: more than ``state_dict(all_ranks=True)`` at 16M and 64M Adam params on 3 ranks, with
#: 512 KiB 1-4 MiB, at the same time (256 KiB: 1-2 MiB, 30% slower at 64M).
CHUNK_BYTES = 512 << 10
#: How many chunks a server writes ahead of the caller's acknowledgements.
WINDOW = 2
#: How long the server waits in one ``store.wait`` before waiting again (idle: no CPU).
_IDLE_WAIT = timedelta(hours=1)
#: How long a stop waits for the server thread.
_JOIN_S = 2.0
#: How often a process that exits looks whether the others exit too.
_LEAVE_POLL_S = 0.05


def _clone(store: Any) -> Any:
    """A new connection to ``store`` (for use by one thread), or None where none can be made."""
    clone = getattr(store, "clone", None)
    if clone is not None:
        try:
            return clone()
        except (RuntimeError, NotImplementedError):
            pass
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):  # torch < 2.8: a client to the same server
        client = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False)
        return dist.PrefixStore(PREFIX, client)
    return None


def shard_chunks(tensors: list[torch.Tensor], size: int) -> Iterator[bytes]:
    """The bytes of ``tensors`` (in order, each as its host copy's raw bytes), in chunks of
    ``size`` bytes (the last one shorter). One chunk is built at a time (one copy of its bytes)."""
    parts: list[memoryview] = []
    held = 0
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        host = tensor.detach().reshape(-1).contiguous().cpu()
        view = memoryview(host.view(torch.uint8).numpy())  # type: ignore[arg-type]
        while len(view):
            take = min(size - held, len(view))
            parts.append(view[:take])
            held += take
            view = view[take:]
            if held == size:
                yield b"".join(parts)
                parts, held = [], 0
    if parts:
        yield b"".join(parts)


#: How a reply is sent: ``send(head, tensors)`` (the head a JSON-able dict; the tensors whose
#: bytes follow it; returns once the caller took them all).
Send = Callable[[dict[str, Any], list[torch.Tensor]], None]
#: What a registered optimizer does with a request: ``answer(request, send)``, calling
#: ``send`` once (a raise before it is sent to the caller as the error).
Answer = Callable[[dict[str, Any], Send], None]


class Service:
    """This process's server of optimizer shards for one default store (see the module
    docstring). Build it with :func:`service`."""

    def __init__(self, store: Any, me: int) -> None:
        self._store = weakref.ref(store)
        self.me = me
        listen, talk = _clone(store), _clone(store)
        if listen is None or talk is None:
            raise RuntimeError(
                f"the default process group's store ({type(store).__name__}) cannot be "
                "connected to again from another thread (Store.clone(), torch >= 2.8, or a "
                "TCPStore)"
            )
        self.listen, self.talk = listen, talk
        talk.add(f"{PREFIX}/live", 1)  # the processes that serve (see leave())
        self.talk_lock = threading.Lock()
        self._answers: dict[str, Any] = {}
        self._next = int(talk.add(f"{PREFIX}/{me}/n", 0)) + 1
        self.thread = threading.Thread(target=self._run, name="oss_plus-serve", daemon=True)
        self.thread.start()

    def serves(self, store: Any) -> bool:
        """Whether this service is for ``store`` (and its thread still runs)."""
        return self._store() is store and self.thread.is_alive()

    def register(self, uid: str, answer: Answer) -> None:
        """Serve ``answer`` under ``uid`` (the same on every rank of the group: the key of
        the optimizer's arrival check). A bound method is held weakly (its optimizer may be
        collected: a read of it is then refused)."""
        held = weakref.WeakMethod(answer) if hasattr(answer, "__self__") else (lambda: answer)
        self._answers = {k: v for k, v in self._answers.items() if v() is not None}
        self._answers[uid] = held

    def post(self, to: int, request: dict[str, Any]) -> None:
        """Put ``request`` in global rank ``to``'s mailbox."""
        with self.talk_lock:
            ticket = int(self.talk.add(f"{PREFIX}/{to}/n", 1))
            self.talk.set(f"{PREFIX}/{to}/{ticket}", json.dumps(request))

    def stop(self, leaving: bool = False) -> None:
        """Stop the thread (a stop request in its own mailbox) and wait for it, briefly;
        unless ``leaving`` (the process exits: :meth:`leave`), it no longer counts as live."""
        if not self.thread.is_alive():
            return
        try:
            self.post(self.me, {"stop": True})
            self.thread.join(_JOIN_S)
            if not leaving:
                with self.talk_lock:
                    self.talk.add(f"{PREFIX}/live", -1)
        except Exception:  # noqa: BLE001, S110 - the store is gone: the thread ends by itself
            pass

    def leave(self, timeout: timedelta) -> None:
        """The process exits: wait, at most ``timeout``, until every process that serves
        leaves too, serving reads meanwhile (a framework may save on one rank while the
        others end: the HF Trainer's last checkpoint), then stop."""
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            with self.talk_lock:
                self.talk.add(f"{PREFIX}/leaving", 1)
            while time.monotonic() < deadline:
                with self.talk_lock:
                    leaving = int(self.talk.add(f"{PREFIX}/leaving", 0))
                    live = int(self.talk.add(f"{PREFIX}/live", 0))
                if leaving >= live:
                    break
                time.sleep(_LEAVE_POLL_S)
        except Exception:  # noqa: BLE001, S110 - the store is gone: nobody can read any more
            pass
        self.stop(leaving=True)

    # --- the server thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            key = f"{PREFIX}/{self.me}/{self._next}"
            try:
                self.listen.wait([key], _IDLE_WAIT)
                raw = self.listen.get(key)
                self.listen.delete_key(key)
            except Exception as exc:  # noqa: BLE001 - a timeout waits again; else the store is gone
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    continue
                return
            self._next += 1
            try:
                request = json.loads(raw)
            except ValueError:
                continue
            if request.get("stop"):
                return
            self._serve(request)

    def _serve(self, request: dict[str, Any]) -> None:
        reply = str(request.get("reply", ""))
        timeout = timedelta(seconds=float(request.get("timeout", 60.0)))
        held = self._answers.get(str(request.get("uid")))
        answer = held() if held is not None else None
        sent: list[bool] = []

        def send(head: dict[str, Any], tensors: list[torch.Tensor]) -> None:
            sent.append(True)
            self._send(reply, head, tensors, timeout)

        try:
            if answer is None:
                send({"error": "gone"}, [])
            else:
                answer(request, send)
        except Exception as exc:  # noqa: BLE001 - told to the caller, which raises it
            logger.warning("serving the optimizer state to a caller failed: %r", exc)
            if not sent:
                with contextlib.suppress(Exception):  # the caller is gone: it raised already
                    send({"error": "raised", "kind": type(exc).__name__, "message": str(exc)}, [])

    def _send(
        self, reply: str, head: dict[str, Any], tensors: list[torch.Tensor], timeout: timedelta
    ) -> None:
        size = CHUNK_BYTES  # read once: the count announced and the cut use the same size
        chunks = shard_chunks(tensors, size) if head.get("error") is None else iter(())
        sizes = sum(t.numel() * t.element_size() for t in tensors) if tensors else 0
        head["chunks"] = -(-sizes // size) if head.get("error") is None else 0
        self.listen.set(f"{reply}/h", json.dumps(head))
        for j, chunk in enumerate(chunks):
            if j >= WINDOW:
                ack = f"{reply}/a/{j - WINDOW}"
                self.listen.wait([ack], timeout)
                self.listen.delete_key(ack)
            self.listen.set(f"{reply}/c/{j}", chunk)
        for j in range(max(0, head["chunks"] - WINDOW), head["chunks"]):
            ack = f"{reply}/a/{j}"
            self.listen.wait([ack], timeout)
            self.listen.delete_key(ack)


_current: Service | None = None
_lock = threading.Lock()


def service() -> Service | str:
    """This process's :class:`Service` for the default process group's store (started on
    the first call, again after the default group is replaced), or why there is none."""
    global _current
    store = positions.default_store()
    if store is None:
        return "torch does not expose the default process group's store"
    with _lock:
        if _current is not None and _current.serves(store):
            return _current
        if _current is not None:
            _current.stop()
            _current = None
        try:
            _current = Service(store, dist.get_rank())
        except Exception as exc:  # noqa: BLE001 - reported when a read needs the service
            return str(exc)
        return _current


@atexit.register
def _leave_at_exit() -> None:
    with _lock:
        found = _current
    if found is not None and found.thread.is_alive():
        found.leave(arrival_timeout())
