"""ZeRO-2 side by side: oss_plus ShardedDataParallel + OSS, DDP + oss_plus.OSS, DDP + the plain
Adam, fairscale's ShardedDataParallel + OSS, on local gloo ranks (each configuration in fresh
processes, so peak RSS is its own).

    python -m oss_plus.bench.zero2 [--world 2] [--steps 6] [--width 2048] [--layers 5]
    python -m oss_plus.bench.zero2 --collectives   # reduce-to-owner collectives on gloo
    python -m oss_plus.bench.zero2 --backend nccl --world 1   # the same on GPUs

Per rank it reports: the median step time (forward, backward with its reduction, optimizer
step), the peak bytes held by ``.grad`` tensors and piece gradients (``OSS.piece_grads()``;
distinct storages, sampled at every
gradient hook, after backward and after the step: fairscale's bucketed grads are views of
its persistent buckets and are counted through them, and so are oss_plus's owned ones; DDP's
own flat buckets and oss_plus's transient reduce buffers are not ``.grad`` and show in RSS
only), and the peak RSS.

Then the side-by-side rows (:data:`ROWS`): the CPU proxy (``--deep-layers`` x (Linear(64, 64)
+ LayerNorm + Tanh), batch 8, Adam ``fused=True``), where per-parameter overhead dominates,
and, only where CUDA exists (``--backend nccl``), issue 26's two GPU models (24 x
(Linear(2048) + LayerNorm + GELU) and 96 x (Linear(512) + LayerNorm + GELU), batch 64, bf16
autocast). The configurations run side by side in the same processes, one iteration each in
turn (order rotated every round), and each row gives each median against DDP + OSS (and,
when ``ddp_adam`` runs, against DDP + the plain Adam). On CUDA
it also counts the device-to-host syncs of one iteration (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime.launch import pick_backend, run_local

CONFIGS = (
    "oss_plus_sdp",
    "oss_plus_sdp_no_unused",
    "oss_plus_sdp_flat",
    "ddp_oss",
    "ddp_adam",
    "fairscale_sdp",
)
#: ``ddp_adam`` is DDP with the plain (unsharded) Adam, what ZeRO is measured against.
#: Also accepted by --configs: oss_plus's SDP forced to one collective. A ``_no_unused``
#: suffix means ``find_unused_parameters=False`` (like DDP's default, and fairscale's SDP,
#: which sends no used flags); ``_flat``, an optimizer with ``partition_rule="flat"``. An
#: ``_again`` suffix runs a second copy of any config (``fairscale_sdp_again``): the spread
#: between two identical rows is the bench's own noise. A ``_hybrid`` suffix shards in groups
#: of ``world // 2`` ranks, replicated across the 2 groups (hybrid ZeRO-2, ``docs/hybrid.md``).
EXTRA_CONFIGS = ("oss_plus_sdp_reduce", "oss_plus_sdp_reduce_scatter")


#: The side-by-side rows: (name, width, layers, activation, batch, bf16 autocast, CUDA only).
#: The CPU proxy stands in for issue 26's two GPU models, which run only where CUDA exists.
ROWS = (
    ("small-layers", 64, 96, "tanh", 8, False, False),
    ("gpu-wide", 2048, 24, "gelu", 64, True, True),
    ("gpu-deep", 512, 96, "gelu", 64, True, True),
)


def _model(width: int, layers: int, deep: bool = False, act: str = "tanh") -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        if deep:
            activation = torch.nn.GELU() if act == "gelu" else torch.nn.Tanh()
            blocks += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), activation]
        else:
            blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks).to(_device())


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize() -> None:
    if _device().type == "cuda":
        torch.cuda.synchronize()


def _grad_bytes(params: Sequence[torch.Tensor], opt: Any = None) -> int:
    """Bytes of the distinct storages holding ``.grad`` s and the optimizer's piece
    gradients (``OSS.piece_grads()``, the flat rule under ZeRO-2)."""
    pieces = getattr(opt, "piece_grads", None)
    grads = [p.grad for p in params if p.grad is not None]
    grads += list(pieces().values()) if callable(pieces) else []
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    return sum(storages.values())


def check_config(config: str) -> None:
    """Raise ``ValueError`` unless ``config`` names a configuration :func:`_wrap` builds.

    Example:
        >>> check_config("oss_plus_sdp_flat_no_unused_again")
        >>> check_config("ddp")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown config 'ddp': expected ...
    """
    name = config.removesuffix("_again")
    if name in ("ddp_oss", "ddp_adam", "fairscale_sdp"):
        return
    base = name.replace("_no_unused", "").replace("_flat", "").replace("_hybrid", "")
    if base in ("oss_plus_sdp", *EXTRA_CONFIGS):
        return
    raise ValueError(
        f"unknown config {name!r}: expected one of {CONFIGS + EXTRA_CONFIGS}, an "
        "oss_plus_sdp config with _no_unused, _flat or _hybrid, or any of them with _again"
    )


def _wrap(config: str, model: torch.nn.Module, bucket: int | None, **adam: Any) -> tuple[Any, Any]:
    """Build ``config`` over ``model``; ``bucket``: ``reduce_buffer_size`` in elements for both
    ShardedDataParallels (None: oss_plus's default, DDP's 25 MiB; fairscale's 2**23)."""
    check_config(config)
    config = config.removesuffix("_again")
    if config.startswith("oss_plus_sdp"):
        from oss_plus import OSS, ShardedDataParallel

        find_unused = "_no_unused" not in config
        rule = "flat" if "_flat" in config else None
        name = config.replace("_no_unused", "").replace("_flat", "").replace("_hybrid", "")
        collective = name.removeprefix("oss_plus_sdp").lstrip("_") or "auto"
        if "_hybrid" in config:  # 2 replica sets of world // 2 shards
            from oss_plus import hybrid_groups

            groups = hybrid_groups(max(1, dist.get_world_size() // 2))
            adam = {**adam, "group": groups.shard, "replicate_group": groups.replicate}
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4, partition_rule=rule, **adam)
        sdp = ShardedDataParallel(
            model,
            opt,
            reduce_buffer_size=bucket,
            collective=collective,
            find_unused_parameters=find_unused,
        )
        return sdp, opt
    if config == "ddp_oss":
        from torch.nn.parallel import DistributedDataParallel

        from oss_plus import OSS

        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4, **adam)
        return DistributedDataParallel(model), opt
    if config == "ddp_adam":
        from torch.nn.parallel import DistributedDataParallel

        plain = torch.optim.Adam(model.parameters(), lr=1e-4, **adam)
        return DistributedDataParallel(model), plain
    from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
    from fairscale.optim import OSS as FairscaleOSS

    opt = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4, **adam)
    return FairscaleSDP(model, opt, reduce_buffer_size=2**23 if bucket is None else bucket), opt


def _iteration(net: Any, opt: Any, x: torch.Tensor, autocast: bool = False) -> None:
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = net(x).float().pow(2).mean()
    loss.backward()
    opt.step()


def _syncs(net: Any, opt: Any, x: torch.Tensor, autocast: bool = False) -> int:
    """Device-to-host syncs in one iteration (CUDA only; -1 elsewhere)."""
    if _device().type != "cuda":
        return -1
    _synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _iteration(net, opt, x, autocast)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _side_by_side_rank(
    rank: int, world: int, configs: list[str], args: dict[str, Any]
) -> dict[str, tuple[float, int]]:
    """A side-by-side row (:data:`ROWS`): every config in these processes, one iteration each in
    turn; returns config -> (median seconds, syncs in one iteration)."""
    adam = {"fused": True}
    width, act, auto = args["width"], args["act"], args["autocast"]
    nets = {
        c: _wrap(c, _model(width, args["layers"], deep=True, act=act), None, **adam)
        for c in configs
    }
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args["batch"], width, generator=gen).to(_device())
    times: dict[str, list[float]] = {c: [] for c in configs}
    for round_ in range(args["warmup"] + args["rounds"]):
        for c in configs[round_ % len(configs) :] + configs[: round_ % len(configs)]:
            dist.barrier()
            _synchronize()
            begin = time.perf_counter()
            _iteration(*nets[c], x, auto)
            _synchronize()
            if round_ >= args["warmup"]:
                times[c].append(time.perf_counter() - begin)
    return {c: (statistics.median(times[c]), _syncs(*nets[c], x, auto)) for c in configs}


def _rank(rank: int, world: int, config: str, args: dict[str, int]) -> dict[str, float]:
    model = _model(args["width"], args["layers"])
    params = list(model.parameters())
    net, opt = _wrap(config, model, args["bucket"])
    peak = [0]

    def sample(*_: Any) -> None:
        peak[0] = max(peak[0], _grad_bytes(params, opt))

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in params]
    times = []
    for step in range(args["steps"]):
        x = torch.randn(args["batch"], args["width"], generator=torch.Generator().manual_seed(step))
        x = x.to(_device())
        dist.barrier()
        _synchronize()
        begin = time.perf_counter()
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        sample()
        opt.step()
        sample()
        _synchronize()
        times.append(time.perf_counter() - begin)
    for hook in hooks:
        hook.remove()
    return {
        "step_s": statistics.median(times[1:]),
        "grad_mb": peak[0] / 2**20,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20
        if _device().type == "cuda"
        else 0.0,
        "model_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
    }


def _collective_rank(rank: int, world: int, numel: int, repeats: int) -> dict[str, float]:
    """Time 'sum a bucket onto one owner' with each candidate collective."""
    buffer = torch.randn(numel, device=_device())
    out = torch.empty(numel // world, device=_device())
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
            _synchronize()
            begin = time.perf_counter()
            fn()
            _synchronize()
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
    p.add_argument(
        "--bucket",
        type=int,
        default=None,
        help="reduce_buffer_size in elements (default: oss_plus's DDP-like 25 MiB buckets, "
        "fairscale's 2**23)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--collectives", action="store_true")
    p.add_argument("--backend", default="gloo", help="gloo, nccl (a GPU per rank) or auto")
    p.add_argument("--deep-layers", type=int, default=96, help="0 skips the small-layers row")
    p.add_argument("--deep-rounds", type=int, default=40)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (the first step is a warm-up), got {args.steps}")
    if args.deep_rounds < 1:
        p.error(f"--deep-rounds must be at least 1, got {args.deep_rounds}")
    try:
        for config in args.configs.split(","):
            check_config(config)
    except ValueError as exc:
        p.error(str(exc))
    backend = pick_backend(args.backend, args.world)
    if args.collectives:
        print(
            f"{'elements':>10} "
            + " ".join(f"{n:>15}" for n in ("reduce", "all_reduce", "reduce_scatter"))
        )
        for numel in (2**16, 2**20, 2**23):
            ms = run_local(_collective_rank, args.world, numel, 7, backend=backend)[0]
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
        f"{'config':>22} {'rank':>4} {'step (s)':>9} {'peak .grad MB':>14} "
        f"{'peak RSS MB':>12} {'model MB':>9} {'CUDA peak MB':>13}"
    )
    configs = args.configs.split(",")
    for config in configs:
        for rank, r in enumerate(run_local(_rank, args.world, config, settings, backend=backend)):
            print(
                f"{config:>22} {rank:>4} {r['step_s']:>9.3f} {r['grad_mb']:>14.1f} "
                f"{r['rss_mb']:>12.1f} {r['model_mb']:>9.1f} {r['cuda_peak_mb']:>13.1f}"
            )
    if args.deep_layers > 0:
        _print_deep(args, configs, backend)
    return 0


def _print_deep(args: argparse.Namespace, configs: list[str], backend: str) -> None:
    cuda = backend == "nccl"
    for name, width, layers, act, batch, auto, gpu_only in ROWS:
        if gpu_only and not cuda:
            continue
        layers = args.deep_layers if name == "small-layers" else layers
        row: dict[str, Any] = dict(
            layers=layers,
            rounds=args.deep_rounds,
            warmup=3,
            width=width,
            act=act,
            batch=batch,
            autocast=auto,
        )
        results = run_local(_side_by_side_rank, args.world, configs, row, backend=backend)
        print(
            f"\n{name}: {layers} x (Linear({width}, {width}) + LayerNorm + {act}), batch "
            f"{batch}, Adam fused{', bf16 autocast' if auto else ''}, {args.world} {backend} "
            f"rank(s), side by side, median of {args.deep_rounds}"
        )
        header = f"{'row':>10} {'config':>22} {'rank':>4} {'iter (ms)':>10} {'vs DDP':>7}"
        print(f"{header} {'syncs':>6} {'vs Adam':>8}")
        for rank, r in enumerate(results):
            anchor = r["ddp_oss"][0] if "ddp_oss" in r else float("nan")
            plain = r["ddp_adam"][0] if "ddp_adam" in r else float("nan")
            for config, (seconds, syncs) in r.items():
                shown = "n/a" if syncs < 0 else str(syncs)
                print(
                    f"{name:>10} {config:>22} {rank:>4} {seconds * 1e3:>10.2f} "
                    f"{seconds / anchor:>6.2f}x {shown:>6} {seconds / plain:>7.2f}x"
                )


if __name__ == "__main__":
    raise SystemExit(main())
