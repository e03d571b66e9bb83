"""ZeRO-2 side by side: oss_plus ShardedDataParallel + OSS, DDP + oss_plus.OSS, fairscale's
ShardedDataParallel + OSS, on local gloo ranks (each configuration in fresh processes, so
peak RSS is its own).

    python -m oss_plus.bench.zero2 [--world 2] [--steps 6] [--width 2048] [--layers 5]
    python -m oss_plus.bench.zero2 --collectives   # reduce-to-owner collectives on gloo

Per rank it reports: the median step time (forward, backward with its reduction, optimizer
step), the peak bytes held by ``.grad`` tensors (distinct storages, sampled at every
gradient hook, after backward and after the step: fairscale's bucketed grads are views of
its persistent buckets and are counted through them; DDP's own flat buckets and oss_plus's
transient reduce buffers are not ``.grad`` and show in RSS only), and the peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._launch import run_local

CONFIGS = ("oss_plus_sdp", "ddp_oss", "fairscale_sdp")


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def _grad_bytes(params: Sequence[torch.Tensor]) -> int:
    storages: dict[int, int] = {}
    for p in params:
        if p.grad is not None:
            storage = p.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _wrap(config: str, model: torch.nn.Module, bucket: int) -> tuple[Any, Any]:
    if config == "oss_plus_sdp":
        from oss_plus import OSS, ShardedDataParallel

        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
        return ShardedDataParallel(model, opt, reduce_buffer_size=bucket), opt
    if config == "ddp_oss":
        from torch.nn.parallel import DistributedDataParallel

        from oss_plus import OSS

        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
        return DistributedDataParallel(model), opt
    from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
    from fairscale.optim import OSS as FairscaleOSS

    opt = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
    return FairscaleSDP(model, opt, reduce_buffer_size=bucket), opt


def _rank(rank: int, world: int, config: str, args: dict[str, int]) -> dict[str, float]:
    model = _model(args["width"], args["layers"])
    params = list(model.parameters())
    net, opt = _wrap(config, model, args["bucket"])
    peak = [0]

    def sample(*_: Any) -> None:
        peak[0] = max(peak[0], _grad_bytes(params))

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in params]
    times = []
    for step in range(args["steps"]):
        x = torch.randn(args["batch"], args["width"], generator=torch.Generator().manual_seed(step))
        dist.barrier()
        begin = time.perf_counter()
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        sample()
        opt.step()
        sample()
        times.append(time.perf_counter() - begin)
    for hook in hooks:
        hook.remove()
    return {
        "step_s": statistics.median(times[1:]),
        "grad_mb": peak[0] / 2**20,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "model_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
    }


def _collective_rank(rank: int, world: int, numel: int, repeats: int) -> dict[str, float]:
    """Time 'sum a bucket onto one owner' with each candidate collective."""
    buffer = torch.randn(numel)
    out = torch.empty(numel // world)
    candidates: dict[str, Callable[[], Any]] = {
        "reduce": lambda: dist.reduce(buffer, dst=1 % world),
        "all_reduce": lambda: dist.all_reduce(buffer),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, buffer),
    }
    result = {}
    for name, fn in candidates.items():
        try:
            fn()
        except RuntimeError:  # not supported by this backend
            continue
        times = []
        for _ in range(repeats):
            dist.barrier()
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        result[name] = statistics.median(times) * 1e3
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the side-by-side bench (or ``--collectives``) and print one table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bucket", type=int, default=2**23)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--collectives", action="store_true")
    args = p.parse_args(argv)
    if args.collectives:
        print(
            f"{'elements':>10} "
            + " ".join(f"{n:>15}" for n in ("reduce", "all_reduce", "reduce_scatter"))
        )
        for numel in (2**16, 2**20, 2**23):
            ms = run_local(_collective_rank, args.world, numel, 7)[0]
            print(
                f"{numel:>10} "
                + " ".join(
                    f"{ms.get(n, float('nan')):>12.2f} ms"
                    for n in ("reduce", "all_reduce", "reduce_scatter")
                )
            )
        return 0
    settings = {k: getattr(args, k) for k in ("width", "layers", "batch", "bucket", "steps")}
    print(
        f"{'config':>15} {'rank':>4} {'step (s)':>9} {'peak .grad MB':>14} "
        f"{'peak RSS MB':>12} {'model MB':>9}"
    )
    for config in args.configs.split(","):
        for rank, r in enumerate(run_local(_rank, args.world, config, settings)):
            print(
                f"{config:>15} {rank:>4} {r['step_s']:>9.3f} {r['grad_mb']:>14.1f} "
                f"{r['rss_mb']:>12.1f} {r['model_mb']:>9.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
