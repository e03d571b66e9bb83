"""Hybrid sharding at 6 ranks (3 shard groups x 2 ranks), by hand: the worker pool of the
suite has 4 workers, so this runs the tasks of tests/test_hybrid.py and
tests/test_hybrid_zero2.py under torchrun and asserts what those tests assert:

    PYTHONPATH=. torchrun --standalone --nproc_per_node 6 tests/hybrid_six_ranks.py

It exits non-zero (an AssertionError on the failing rank) unless, on every rank: ZeRO-1
hybrid is bit-identical to DDP over the 6 ranks + Adam (three rules, no_sync, an unused
layer) with the same consolidated state and clip norms; ZeRO-2 hybrid holds gradients on
their owners only, within the summation-order bound of DDP's at the first step, params
within 1e-5 (fp32) / 1e-2 (bf16 wire) and identical on every rank; the scaler skips the
same steps as torch's GradScaler.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import pytest  # noqa: E402
import test_hybrid as zero1  # noqa: E402
import test_hybrid_zero2 as zero2  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from oss_plus.testing import RankContext  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 6, "run with --nproc_per_node 6"
    rank = dist.get_rank()
    ctx = RankContext(dist.new_group(list(range(6))), rank, 6, rank, {})
    for rule in ("fairscale", "torch", "flat"):
        torch.manual_seed(0)
        same, problem = zero1.exact_task(ctx, rule)
        assert same and problem is None, (rule, problem)
        for collective in ("reduce", "reduce_scatter"):
            torch.manual_seed(0)
            checks, diff, replicas = zero2.parity_task(ctx, rule, None, collective)
            assert all(c[0] for c in checks) and checks[0][1], (rule, collective, checks)
            assert diff < 1e-5 and replicas, (rule, collective, diff)
    for collective in ("reduce", "reduce_scatter"):
        torch.manual_seed(0)
        checks, diff, replicas = zero2.parity_task(ctx, "fairscale", torch.bfloat16, collective)
        assert all(c[0] for c in checks) and checks[0][1] and diff < 1e-2 and replicas
    torch.manual_seed(0)
    norms, close = zero1.clip_task(ctx)
    assert close and all(a == pytest.approx(b, rel=1e-6) and b > 0.05 for a, b in norms)
    torch.manual_seed(0)
    rows, diff, replicas = zero2.scaler_task(ctx)
    assert all(a[1] == b[1] for a, b in rows) and rows[1][0][1] == 2.0**11, rows
    assert diff < 1e-5 and replicas
    dist.barrier()
    if rank == 0:
        print("hybrid 3 x 2: every check passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
