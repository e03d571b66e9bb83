"""What every benchmark measures on a rank: the slowest rank's time, CPU time, RSS.

Linux only (RSS comes from ``/proc``), like the benchmarks themselves; no third-party package.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    """Wait for this rank's GPU work (no-op on CPU)."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def rss() -> int:
    """This process's resident set size, in bytes."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(
    fn: Callable[[], Any], count: int, slowest: torch.Tensor, cpu: list[float] | None = None
) -> list[float]:
    """Time ``count`` calls of ``fn``; each is the slowest rank's time.

    Collective: every rank calls it. ``slowest`` is a one-element float64 tensor on
    :func:`device` (reused as the reduction buffer). With ``cpu``, also append the CPU time
    every rank spent in each call, summed over the ranks (user + system, every thread of the
    process, so gloo's threads and the kernel's copies for its sockets count): a step that
    keeps every core busy has ``cpu / time`` equal to the number of cores.
    """
    times = []
    for _ in range(count):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        synchronize()
        elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
        slowest.fill_(elapsed)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest))
        if cpu is not None:
            slowest.fill_(used)
            dist.all_reduce(slowest, op=dist.ReduceOp.SUM)
            cpu.append(float(slowest))
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
