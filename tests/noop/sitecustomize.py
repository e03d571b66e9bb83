"""Opt-in check that the suite fails when the optimizer does nothing (never imported by pytest).

Put this directory first on ``PYTHONPATH`` and name a mutant in ``OSS_PLUS_NOOP``; Python
imports this ``sitecustomize`` at start-up in pytest, in the pool's forkserver (so in every
worker) and in ``torchrun`` children, and breaks the library the same way everywhere:

* ``step``: ``OSS.step`` only runs the closure (no local step, no sync); the step overlapped
  with DDP (:class:`oss_plus.overlap.DDPOverlap`) neither steps nor broadcasts;
* ``local``: the inner optimizer's step does nothing, the sync still runs (in the overlapped
  step too: its buckets are broadcast unchanged);
* ``sync``: the local step runs, the parameter sync (``BucketSync.launch`` and ``sync``)
  does nothing (replicas diverge); in the
  overlapped step, no piece is broadcast.

Example (see CONTRIBUTING.md, "Every test must fail on a no-op")::

    OSS_PLUS_NOOP=step PYTHONPATH=tests/noop:. python -m pytest tests/test_amp.py

Every test that trains must then fail.
"""

from __future__ import annotations

import os
from typing import Any

_MODE = os.environ.get("OSS_PLUS_NOOP", "")


def _install(mode: str) -> None:
    from oss_plus import OSS
    from oss_plus.overlap import DDPOverlap
    from oss_plus.overlap.layout import OverlapSync
    from oss_plus.wire.sync import BucketSync

    real_step = OSS.step

    def closure_only(self: Any, closure: Any = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def inner_noop(self: Any, closure: Any = None, **kwargs: Any) -> Any:
        self.optim.step = lambda closure=None, **kw: closure() if closure is not None else None
        return real_step(self, closure, **kwargs)

    def no_sync(self: Any, wire: Any = None, error: Any = None) -> None:
        if error is not None:
            raise error

    def no_launch(self: Any, wire: Any = None, code: int = 0) -> Any:
        from oss_plus.wire.inflight import InFlight

        return InFlight([], {}, None, self.group)

    def no_overlap_step(self: Any, entry: Any, bucket: Any, value: Any) -> None:
        return None

    def no_broadcast(self: Any, entry: Any, wire: Any, failed: bool = False) -> list[Any]:
        return []

    if mode == "step":
        OSS.step = closure_only  # type: ignore[method-assign]
        DDPOverlap._step = no_overlap_step  # type: ignore[method-assign]
        DDPOverlap._broadcast = lambda self, entry: None  # type: ignore[method-assign]
    elif mode == "local":
        OSS.step = inner_noop  # type: ignore[method-assign]
        DDPOverlap._step = no_overlap_step  # type: ignore[method-assign]
    elif mode == "sync":
        BucketSync.sync = no_sync  # type: ignore[method-assign]
        BucketSync.launch = no_launch  # type: ignore[method-assign]
        OverlapSync.broadcast = no_broadcast  # type: ignore[method-assign]
    else:
        raise SystemExit(f"OSS_PLUS_NOOP={mode!r}: expected step, local or sync")


if _MODE:
    _install(_MODE)
