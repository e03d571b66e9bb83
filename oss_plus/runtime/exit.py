"""At interpreter exit, let gloo's worker threads finish before the interpreter finalizes.

Why: a gloo worker thread runs each collective and drops its references to the tensors (and
to the work's thread-local state) *after* ``wait()`` returned. When such a reference is the
last one to a Python object, dropping it takes the GIL. If the main thread is finalizing the
interpreter by then, CPython ends the worker with a forced unwind and the process aborts:
SIGABRT, "terminate called without an active exception" (``docs/reliability.md``, "Process
exit"). oss_plus waits for its own collectives (:func:`oss_plus.runtime.dist.await_release`), but it
cannot wait for collectives it does not see: a training script's or a test's own
``dist.all_gather`` as the last collective of the process (fairscale's test suites end that
way). Measured with fresh 2-rank processes ending in three plain ``all_gather`` calls of
temporaries: 9 of 20 aborted with a 1 s switch interval, 5 of 20 with the default 5 ms;
``tests/lifecycle.py --torch-last`` (an ``OSS`` stepped first): 6 of 10.

So the first time oss_plus resolves a process group (any oss_plus object or collective), or
when ``oss_plus.compat.fairscale.install()`` runs, it registers one ``atexit`` handler that
sleeps :data:`EXIT_DRAIN_S` (releasing the GIL) before finalization, if a gloo group exists
or existed then: a worker still dropping references gets the GIL then, while the interpreter
is intact (with it: 0 of 30 and 0 of 10). ``install()`` registers it because a process that
installs the adapter may train with torch's collectives only (issue 36: ``install()``, plain
DDP + Adam, exit; 1 s switch interval: 13 of 119 runs aborted when only an oss_plus
collective registered the handler, a gloo worker destroying DDP's finished all-reduce during
``finalize_modules``; 0 of 60 with it). Where the worker is still running or runnable after
the pause (one rank in ten had one running when the handler started), the handler goes on
releasing the GIL while any of gloo's worker threads is (Linux: their state in
``/proc/self/task``), for at most :data:`EXIT_DRAIN_MAX_S`: a margin for loaded machines,
where a runnable thread can wait longer than the pause for a core.
A process that only ever used NCCL exits without the pause. The handler runs only in
processes that exit through the interpreter (``sys.exit``, the end of the script,
``mp.spawn``'s children); ``os._exit`` skips finalization, and the race with it.
"""

from __future__ import annotations

import atexit
import os
import time

__all__ = ["EXIT_DRAIN_MAX_S", "EXIT_DRAIN_S", "busy_gloo_workers", "drain_at_exit"]

#: How long the exit handler releases the GIL for gloo's workers (seconds).
EXIT_DRAIN_S = 0.05
#: The longest it then goes on while a gloo worker thread is running or runnable (seconds).
EXIT_DRAIN_MAX_S = 2.0
#: The names torch gives gloo's worker threads (``ProcessGroupGloo::runLoop``).
GLOO_WORKER_NAMES = ("pt_gloo_runloop",)

_registered = False
_saw_gloo = False


def _drain() -> None:
    if not _used_gloo():
        return
    time.sleep(EXIT_DRAIN_S)
    deadline = time.monotonic() + EXIT_DRAIN_MAX_S
    while busy_gloo_workers() and time.monotonic() < deadline:
        time.sleep(0.005)


def busy_gloo_workers() -> int:
    """How many of this process's gloo worker threads are running or runnable now (state
    ``R`` in ``/proc/self/task/<tid>/stat``); 0 where that cannot be read (not Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    busy = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() not in GLOO_WORKER_NAMES:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        busy += state == "R"
    return busy


def _used_gloo() -> bool:
    """Whether a gloo process group was made in this process (any may still have workers)."""
    try:
        import torch.distributed as dist

        backends = dist.distributed_c10d._world.pg_map.values()  # (backend, store) per group
        return _saw_gloo or any("gloo" in str(b).lower() for b, _ in backends)
    except Exception:  # noqa: BLE001 - a private table: when it moved, pause anyway
        return True


def drain_at_exit() -> None:
    """Register the exit handler (once per process; later calls do nothing)."""
    global _registered, _saw_gloo
    _saw_gloo = _saw_gloo or _used_gloo()
    if not _registered:
        atexit.register(_drain)
        _registered = True
