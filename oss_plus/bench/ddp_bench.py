"""The DDP benchmark: full training iterations (forward, backward, step) side by side.

``oss-plus bench --ddp`` (or ``python -m oss_plus.bench.ddp_bench``) times, in one set
of spawned ranks, DDP + each optimizer row below on the same model, data and ranks:

* ``oss_plus_overlap`` / ``oss_plus_overlap_interleaved``: :func:`oss_plus.overlap.overlap_with_ddp`
  (the step inside DDP's backward, both schedules);
* ``oss_plus``: DDP + :class:`oss_plus.OSS`, ``step()`` after ``backward()``;
* ``oss_plus_attach``: the same, the parameter sync overlapped with the next forward
  (:meth:`oss_plus.OSS.attach`: ``step()`` returns with the sync in flight, each module
  waits for its own buckets);
* ``torch_zero`` / ``torch_zero_bv``: DDP + torch's ZeroRedundancyOptimizer (without / with
  ``parameters_as_bucket_view``), ``step()`` after ``backward()``;
* ``torch_zero_overlap``: torch's own ``hook_with_zero_step`` (on gloo with torch's guard
  bypassed: its non-interleaved hook runs there; its interleaved one hangs, so it is absent);
* ``fairscale``: DDP + fairscale's OSS;
* ``ddp_unsharded``: DDP + the plain optimizer (the reference).

Every round builds each row fresh from the same initial model (order rotated each round),
runs ``warmup`` iterations (torch's overlap updates nothing in its first 2), then times
``steps`` iterations; an iteration's time is the slowest rank's (barrier before and
``all_reduce(MAX)`` after, untimed). The final params of each row are compared with the
reference's: the oss_plus rows are bit-identical to it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS
from oss_plus.bench.impls import OPTIMIZERS, check_common, linear_layers
from oss_plus.bench.measure import device, timed
from oss_plus.overlap import overlap_with_ddp
from oss_plus.runtime.launch import pick_backend, run_local, threads_per_rank

#: Rows, in table order: (label, needs).
ROWS: dict[str, tuple[str, str | None]] = {
    "oss_plus_overlap": ("DDP + oss_plus, step overlapped", None),
    "oss_plus_overlap_interleaved": ("DDP + oss_plus, step interleaved", None),
    "oss_plus": ("DDP + oss_plus, step after backward", None),
    "oss_plus_attach": ("DDP + oss_plus, sync overlapped with forward", None),
    "torch_zero": ("DDP + torch ZeRO", None),
    "torch_zero_bv": ("DDP + torch ZeRO bucket view", None),
    "torch_zero_overlap": ("DDP + torch ZeRO overlap (hook_with_zero_step)", None),
    "fairscale": ("DDP + fairscale OSS", "fairscale"),
    "ddp_unsharded": ("DDP + unsharded optimizer", None),
}
#: The peers the overlapped rows are compared with (ratios in the summary).
PEERS = ("torch_zero", "torch_zero_bv", "torch_zero_overlap", "fairscale")


@dataclass(frozen=True)
class DDPBenchConfig:
    """What to run; ``size`` in millions of params (``Linear(width, width)`` layers).

    Raises:
        ValueError: a value out of range or an unknown optimizer / row.
    """

    size: float = 10.0
    width: int = 1024
    batch: int = 32
    world_size: int = 2
    optimizer: str = "adam"
    steps: int = 8
    warmup: int = 3
    rounds: int = 3
    bucket_cap_mb: float = 25.0
    impls: tuple[str, ...] = tuple(ROWS)
    backend: str = "auto"
    threads: int = 0

    def __post_init__(self) -> None:
        check_common(self, ("width", "batch", "world_size", "steps", "rounds"))
        unknown = [k for k in self.impls if k not in ROWS]
        if unknown:
            raise ValueError(f"unknown --impls {unknown}: choose from {list(ROWS)}")
        if self.size <= 0 or self.bucket_cap_mb <= 0 or self.warmup < 3:
            raise ValueError("size and bucket cap must be > 0 and warmup >= 3 (torch's overlap)")

    @property
    def layers(self) -> int:
        """How many ``Linear(width, width)`` layers make ``size`` million params."""
        return linear_layers(self.size, self.width)


# ---------------------------------------------------------------------- on every rank
def _model(cfg: DDPBenchConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(cfg.layers):
        layers += [torch.nn.Linear(cfg.width, cfg.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device())


def _claims_nccl(group: Any = None) -> Any:
    return "nccl"


@contextlib.contextmanager
def _torch_gloo_guard_bypassed() -> Iterator[None]:
    """torch's overlap hooks refuse gloo; the non-interleaved one runs fine there."""
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook

    original = dist.get_backend
    ddp_zero_hook.dist.get_backend = _claims_nccl
    try:
        yield
    finally:
        ddp_zero_hook.dist.get_backend = original


def _build(key: str, ddp: DDP, optimizer: str) -> Callable[[], Any] | None:
    """Set up row ``key`` on ``ddp``; return the per-iteration step (None: inside backward)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    params = list(ddp.parameters())
    if key.startswith("oss_plus"):
        opt = OSS(params, optim=cls, **kwargs)
        if key == "oss_plus_attach":
            opt.attach(ddp)
        if key in ("oss_plus", "oss_plus_attach"):
            return opt.step
        overlap_with_ddp(ddp, opt, interleaved=key.endswith("interleaved"))
        return None
    if key.startswith("torch_zero"):
        from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer

        overlap = key == "torch_zero_overlap"
        zero = ZeroRedundancyOptimizer(
            params,
            cls,
            parameters_as_bucket_view=key == "torch_zero_bv",
            overlap_with_ddp=overlap,
            **kwargs,
        )
        if not overlap:
            return zero.step
        with _torch_gloo_guard_bypassed():
            ddp.register_comm_hook(
                None, ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, zero)
            )
        return None
    if key == "fairscale":
        from fairscale.optim import OSS as FairscaleOSS

        return FairscaleOSS(params, optim=cls, **kwargs).step
    return cls(params, **kwargs).step


def _iteration(ddp: DDP, step: Callable[[], Any] | None, x: torch.Tensor) -> None:
    for p in ddp.parameters():
        p.grad = None
    ddp(x).pow(2).mean().backward()
    if step is not None:
        step()


def _row(cfg: DDPBenchConfig, key: str, model: torch.nn.Module, slowest: torch.Tensor) -> dict:
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=cfg.bucket_cap_mb)
    step = _build(key, ddp, cfg.optimizer)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [torch.randn(cfg.batch, cfg.width, generator=gen).to(device()) for _ in range(4)]
    for i in range(cfg.warmup):
        _iteration(ddp, step, batches[i % 4])
    times = []
    for i in range(cfg.steps):
        times += timed(functools.partial(_iteration, ddp, step, batches[i % 4]), 1, slowest)
    settle = getattr(getattr(step, "__self__", None), "settle", None)
    if settle is not None:  # a sync still in flight (oss_plus_attach)
        settle()
    final = torch.cat([p.detach().reshape(-1).cpu() for p in ddp.parameters()])
    return {"times": times, "final": final}


def timing_rank(rank: int, world: int, cfg: DDPBenchConfig, keys: list[str]) -> dict[str, Any]:
    """Time every row of ``keys`` (rank 0's result is used)."""
    slowest = torch.zeros(1, dtype=torch.float64, device=device())
    model = _model(cfg)
    out: dict[str, Any] = {k: {"times": []} for k in keys}
    finals: dict[str, torch.Tensor] = {}
    for r in range(cfg.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            row = _row(cfg, key, model, slowest)
            out[key]["times"] += row["times"]
            finals[key] = row["final"]
            gc.collect()
    reference = finals.get("ddp_unsharded")
    for key in keys:
        if reference is not None:
            out[key]["max_diff"] = float((finals[key] - reference).abs().max())
    return out


# ---------------------------------------------------------------------- orchestration
def run(cfg: DDPBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; return plain data (config, machine, rows, ratios, skipped)."""
    import importlib.util

    skipped = {
        k: f"{need} is not installed"
        for k, (_, need) in ROWS.items()
        if k in cfg.impls and need and importlib.util.find_spec(need) is None
    }
    keys = [k for k in cfg.impls if k not in skipped]
    backend = pick_backend(cfg.backend, cfg.world_size)
    threads = threads_per_rank(cfg.threads, cfg.world_size)
    log(
        f"DDP iterations: {cfg.layers} x Linear({cfg.width}, {cfg.width}) "
        f"({cfg.layers * (cfg.width * cfg.width + cfg.width) / 1e6:.1f}M params), batch "
        f"{cfg.batch}, {cfg.optimizer}, {cfg.world_size} ranks ({backend}, {threads} thread(s) "
        f"each), {cfg.rounds} rounds x {cfg.steps} iterations, rows: {', '.join(keys)}"
    )
    raw = run_local(timing_rank, cfg.world_size, cfg, keys, backend=backend, threads=threads)[0]
    rows = {}
    for key in keys:
        times = sorted(raw[key]["times"])
        rows[key] = {
            "label": ROWS[key][0],
            "iter_s": statistics.median(times),
            "iter_p10_s": times[len(times) // 10],
            "iter_p90_s": times[(len(times) * 9) // 10],
            "max_diff_vs_unsharded": raw[key].get("max_diff"),
            "times_s": raw[key]["times"],
        }
    machine = {"backend": backend, "threads_per_rank": threads, "torch": torch.__version__}
    return {
        "config": asdict(cfg),
        "machine": machine,
        "rows": rows,
        "ratios": _ratios(rows),
        "skipped": skipped,
    }


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Iteration time of each overlapped row divided by each other row's (< 1: faster)."""
    return {
        key: {other: rows[key]["iter_s"] / rows[other]["iter_s"] for other in rows if other != key}
        for key in ("oss_plus_overlap", "oss_plus_overlap_interleaved", "oss_plus_attach")
        if key in rows
    }


def table(result: dict[str, Any]) -> str:
    """A plain-text table of the rows."""
    lines = [f"{'row':<50} {'iter ms':>9} {'p10':>8} {'p90':>8} {'max |diff| vs unsharded':>24}"]
    for row in result["rows"].values():
        diff = row["max_diff_vs_unsharded"]
        lines.append(
            f"{row['label']:<50} {row['iter_s'] * 1e3:>9.1f} {row['iter_p10_s'] * 1e3:>8.1f} "
            f"{row['iter_p90_s'] * 1e3:>8.1f} {'-' if diff is None else f'{diff:.3g}':>24}"
        )
    for key, reason in result["skipped"].items():
        lines.append(f"{ROWS[key][0]:<50} skipped: {reason}")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> list[str]:
    """One line per overlapped row: its iteration time against the others."""
    lines = []
    for key, ratios in result["ratios"].items():
        parts = [f"{ratios[o]:.2f}x {o}" for o in ("oss_plus", *PEERS) if o in ratios]
        lines.append(f"{key}: iteration time = " + ", ".join(parts))
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``python -m oss_plus.bench.ddp_bench``."""
    d = DDPBenchConfig()
    add = parser.add_argument
    add("--size", type=float, default=d.size, help=f"model size in M params (default {d.size:g})")
    add("--width", type=int, default=d.width, help=f"Linear width (default {d.width})")
    add("--batch", type=int, default=d.batch, help=f"batch size per rank (default {d.batch})")
    add("--world-size", type=int, default=d.world_size, help="ranks (default 2)")
    add("--optimizer", default=d.optimizer, help="adam, adamw or sgd (default adam)")
    add(
        "--steps", type=int, default=d.steps, help=f"timed iterations per round (default {d.steps})"
    )
    add(
        "--warmup",
        type=int,
        default=d.warmup,
        help=f"untimed iterations per round (default {d.warmup})",
    )
    add("--rounds", type=int, default=d.rounds, help=f"rounds (default {d.rounds})")
    add("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="DDP bucket size (default 25)")
    add("--impls", help="comma-separated rows (default all): " + ",".join(ROWS))
    add("--backend", default=d.backend, help="auto, gloo or nccl")
    add(
        "--threads",
        type=int,
        default=d.threads,
        help="intra-op threads per rank (default cores // ranks)",
    )
    add("--out", default="bench-results", help="directory for ddp_bench.json")


def config_from_args(args: argparse.Namespace) -> DDPBenchConfig:
    """Build the config from parsed flags (unset ones keep their defaults)."""
    names = (
        "size",
        "width",
        "batch",
        "world_size",
        "optimizer",
        "steps",
        "warmup",
        "rounds",
        "bucket_cap_mb",
        "backend",
        "threads",
    )
    values: dict[str, Any] = {
        n: getattr(args, n) for n in names if getattr(args, n, None) is not None
    }
    if getattr(args, "impls", None):
        values["impls"] = tuple(x.strip() for x in args.impls.split(",") if x.strip())
    if getattr(args, "quick", False):  # bench --ddp --quick: one short round
        values.setdefault("rounds", 1)
        values.setdefault("steps", 4)
    return DDPBenchConfig(**values)


def main_from_args(args: argparse.Namespace) -> int:
    """Run, print the table and ratios, write ``ddp_bench.json`` under ``--out``."""
    result = run(config_from_args(args), log=lambda line: print(f"[ddp-bench] {line}", flush=True))
    print()
    print(table(result))
    print()
    for line in summary(result):
        print(line)
    out = Path(getattr(args, "out", None) or "bench-results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ddp_bench.json").write_text(json.dumps(result, indent=1))
    print(f"results: {out / 'ddp_bench.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oss_plus.bench.ddp_bench", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
