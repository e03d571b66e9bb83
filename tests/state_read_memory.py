"""Peak host memory per rank of the whole optimizer state read three ways (issue 56).

Run: torchrun --nproc_per_node 3 tests/state_read_memory.py MODE PARAMS
MODE: all_ranks (state_dict(all_ranks=True) on every rank), every (state_dict() on every rank,
read), one (state_dict() on rank 0 alone, read). Prints, per rank, the rise of the peak
resident set size over the resident set just before the call (Linux: the peak is reset with
``/proc/self/clear_refs`` first, after a ``malloc_trim``; elsewhere, the rise of
``ru_maxrss`` over its value before the call, which the step's own peak can hide), the
resident set still held after the call, and the time. The docs' table
(``docs/benchmarks.md``, "Reading the whole state") comes from it.
"""

import ctypes
import gc
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from oss_plus import OSS

_STATUS = Path("/proc/self/status")


def _status_mib(key: str) -> float | None:
    if not _STATUS.exists():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return None


def reset_peak() -> float:
    """Start measuring: the current resident set (MiB), the peak reset to it where Linux can."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    now = _status_mib("VmRSS:")
    assert now is not None
    return now


def peak_mib() -> float:
    found = _status_mib("VmHWM:")
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    mode, params = sys.argv[1], int(float(sys.argv[2]))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Parameter(torch.randn(params // 16)) for _ in range(16)]
    opt = OSS(layers, torch.optim.Adam, lr=1e-3)
    for p in layers:
        p.grad = torch.ones_like(p)
    opt.step()
    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    if mode == "all_ranks":
        sd = opt.state_dict(all_ranks=True)
    elif mode == "every" or rank == 0:
        sd = opt.state_dict()
    else:
        sd = None
    took = time.perf_counter() - start
    rise = peak_mib() - before
    held = (_status_mib("VmRSS:") or before) - before
    dist.barrier()
    state_mib = 2 * params * 4 / 2**20
    print(
        f"{mode} rank {rank}: peak RSS +{rise:.0f} MiB, held +{held:.0f} MiB (whole Adam state "
        f"{state_mib:.0f} MiB), {took:.2f} s, got {'whole' if sd is not None else 'nothing'}",
        flush=True,
    )
    del sd
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
