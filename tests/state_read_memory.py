"""Peak host memory per rank of the whole optimizer state read three ways (issue 56).

Run: torchrun --nproc_per_node 3 tests/state_read_memory.py MODE PARAMS
MODE: all_ranks (state_dict(all_ranks=True) on every rank), every (state_dict() on every rank,
read), one (state_dict() on rank 0 alone, read). Prints, per rank, the rise of the peak
resident set size (ru_maxrss) over the process's peak before the call, in MiB, and the time.
"""

import resource
import sys
import time

import torch
import torch.distributed as dist

from oss_plus import OSS


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
    before, start = peak_mib(), time.perf_counter()
    if mode == "all_ranks":
        sd = opt.state_dict(all_ranks=True)
    elif mode == "every" or rank == 0:
        sd = opt.state_dict()
    else:
        sd = None
    took = time.perf_counter() - start
    rise = peak_mib() - before
    dist.barrier()
    state_mib = 2 * params * 4 / 2**20
    print(
        f"{mode} rank {rank}: peak RSS +{rise:.0f} MiB (whole Adam state {state_mib:.0f} MiB), "
        f"{took:.2f} s, got {'whole' if sd is not None else 'nothing'}",
        flush=True,
    )
    del sd
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
