"""What every benchmark measures on a rank: the slowest rank's time, CPU time, RSS.

Linux only (RSS comes from ``/proc``), like the benchmarks themselves; no third-party package.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime import dist as _dist


def device(requested: str = "auto") -> torch.device:
    """This rank's param device: ``requested`` (``cpu``/``cuda``), or for ``auto`` its GPU
    under NCCL and the CPU otherwise. Ranks share the GPUs round-robin (gloo over CUDA
    tensors may put several ranks on one GPU)."""
    if requested == "cuda" or (requested == "auto" and dist.get_backend() == "nccl"):
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where this rank's collectives need their tensors: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    """Wait for this process's GPU work (no-op when it used no GPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def rss() -> int:
    """This process's resident set size, in bytes."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: Where torch hands a tensor's value to Python (a device-to-host read on an accelerator);
#: ``cpu``/``numpy`` count only for tensors not already on the CPU.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
HOST_MOVES = ("cpu", "numpy")


@contextlib.contextmanager
def host_reads() -> Iterator[list[str]]:
    """Record, by method name, every read of a tensor's value on the host inside the block.

    Patches those methods of ``torch.Tensor`` for the block's duration (this process only),
    so it sees reads on any device, CPU included, where ``torch.cuda.set_sync_debug_mode``
    sees nothing. Not for timed code.
    """
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS + HOST_MOVES}
    inside = [False]  # a torch function mode calls the (patched) method again: count once

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                return original(self, *args, **kwargs)
            if name in HOST_READS or self.device.type != "cpu":
                seen.append(name)
            inside[0] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                inside[0] = False

        return wrapper

    for name, original in saved.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield seen
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def count_syncs(fn: Callable[[], Any], on: torch.device) -> int:
    """Run ``fn`` once; return its device-to-host synchronisations.

    On CUDA, those ``torch.cuda.set_sync_debug_mode("warn")`` reports (what the device
    really waits for); elsewhere the host reads of :func:`host_reads`.
    """
    if on.type != "cuda":
        with host_reads() as seen:
            fn()
        return len(seen)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


def peak_over_steady(fn: Callable[[], Any], on: torch.device) -> int | None:
    """Bytes the device's allocator held at its peak during ``fn`` above what it held before
    (None off CUDA: see the RSS columns)."""
    if on.type != "cuda":
        return None
    torch.cuda.synchronize(on)
    steady = torch.cuda.memory_allocated(on)
    torch.cuda.reset_peak_memory_stats(on)
    fn()
    torch.cuda.synchronize(on)
    return int(torch.cuda.max_memory_allocated(on) - steady)


def timed(
    fn: Callable[[], Any],
    count: int,
    slowest: torch.Tensor,
    cpu: list[float] | None = None,
    host: list[float] | None = None,
) -> list[float]:
    """Time ``count`` calls of ``fn``; each is the slowest rank's time.

    Collective: every rank calls it. ``slowest`` is a one-element float64 tensor on
    :func:`comm_device` (reused as a reduction buffer). A call's time is its wall time
    until the device finished; on CUDA, the span between CUDA events recorded around it.
    With ``host``, also append the slowest rank's host time (until ``fn`` returned, before
    waiting for the device). With ``cpu``, also append the CPU time every rank spent in
    each call, summed over the ranks (user + system, every thread of the process, so gloo's
    threads and the kernel's copies for its sockets count): a step that keeps every core
    busy has ``cpu / time`` equal to the number of cores.
    """
    times = []
    events = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(count):
        dist.barrier()
        if events:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        returned = time.perf_counter()
        if events:
            end.record()
        synchronize()
        elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
        if events:
            elapsed = begin.elapsed_time(end) / 1e3
        pair = torch.tensor([elapsed, returned - start], dtype=torch.float64)
        pair = pair.to(slowest.device)
        with _dist.released(dist.group.WORLD, pair):  # outside the timed span
            dist.all_reduce(pair, op=dist.ReduceOp.MAX)
        elapsed_max, host_max = pair.tolist()
        times.append(elapsed_max)
        if host is not None:
            host.append(host_max)
        if cpu is not None:
            slowest.fill_(used)
            with _dist.released(dist.group.WORLD, slowest):
                dist.all_reduce(slowest, op=dist.ReduceOp.SUM)
            cpu.append(float(slowest[0]))
    return times


class PeakRSS:
    """Samples this process's RSS from a thread; ``peak`` is the largest value seen (bytes)."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
