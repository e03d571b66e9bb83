"""``oss-plus bench`` (``python -m oss_plus bench``): the benchmarks from the command line.

The step benchmark by default: the main rows (:data:`~oss_plus.bench.step_config.MAIN_IMPLS`),
3 rounds, the RSS of each, no sweeps (about a minute of 2 idle cores); ``--quick`` one round,
``--full`` every row and the size sweep. It prints where the JSON goes first, a line of
progress on stderr per round and row, then a summary within 100 columns
(:mod:`oss_plus.bench.summary`; ``--details``: every column). ``--ddp`` for full DDP
iterations, ``--checkpoint`` for checkpoint save / load, ``--state-memory`` for the
optimizer-state bytes of low-bit optimizers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from oss_plus.bench import report
from oss_plus.bench.impls import IMPLS
from oss_plus.bench.progress import PREFIX, say
from oss_plus.bench.step_bench import MEMORY_IMPLS, run
from oss_plus.bench.step_config import ALL_IMPLS, FULL_SWEEP_SIZES, BenchConfig
from oss_plus.bench.summary import summary_table

#: ``--quick``: one round, few steps, no sweeps; the main rows only.
QUICK = {
    "rounds": 1,
    "steps": 4,
    "warmup": 1,
    "memory_steps": 2,
    "sweep_sizes": (),
    "sweep_worlds": (),
}
QUICK_IMPLS = ("oss_plus", "oss_plus_bf16", "fairscale", "torch_zero_bv", "unsharded", "floor")
#: ``--full``: every row (but the opt-in control), the RSS of the main rows, the size sweep.
FULL = {"impls": ALL_IMPLS, "sweep_sizes": FULL_SWEEP_SIZES, "memory_impls": MEMORY_IMPLS}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build the :class:`BenchConfig` the flags describe (``--quick`` or ``--full`` first,
    flags override).

    Raises:
        ValueError: an invalid value (see :class:`BenchConfig`), or --quick with --full.
    """
    if args.quick and args.full:
        raise ValueError("--quick and --full are different runs: pick one")
    values: dict[str, Any] = dict(QUICK, impls=QUICK_IMPLS) if args.quick else {}
    values.update(FULL if args.full else {})
    flags = {
        "size": args.size,
        "width": args.width,
        "world_size": args.world_size,
        "optimizer": args.optimizer,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "backend": args.backend,
        "threads": args.threads,
        "tensors": args.tensors,
        "device": args.device,
        "impls": _names(args.impls) if args.impls else None,
        "sweep_sizes": _floats(args.sweep_sizes) if args.sweep_sizes is not None else None,
        "sweep_worlds": _ints(args.sweep_worlds) if args.sweep_worlds is not None else None,
        "profile": _names(args.profile) if args.profile else None,
        "memory_impls": _names(args.memory_impls) if args.memory_impls else None,
        "sweep_impls": _names(args.sweep_impls) if args.sweep_impls else None,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    if args.no_memory:
        values["memory"] = False
    if args.blocks:
        values["interleave"] = False
    return BenchConfig(**values)


#: The benchmarks other than the step bench: flag -> (module, its own argv from ours).
_OTHERS = ("ddp", "checkpoint", "async_checkpoint", "zero2", "state_memory")


def _async_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--params-m", str(args.size or 20.0), "--world", str(args.world_size or 2)]
    return argv + (["--reps", str(args.rounds)] if args.rounds else [])


def _run(args: argparse.Namespace) -> int:
    chosen = [name for name in _OTHERS if getattr(args, name)]
    if len(chosen) > 1:
        flags = " and ".join("--" + name.replace("_", "-") for name in chosen)
        raise ValueError(f"{flags} are different benchmarks: pick one")
    if args.state_memory:
        from oss_plus.bench import state_memory

        return state_memory.main_from_args(args)
    if args.zero2:
        from oss_plus.bench import zero2

        argv = ["--world", str(args.world_size or 2)]
        argv += ["--steps", str(args.steps)] if args.steps else []
        argv += ["--width", str(args.width)] if args.width else []
        argv += ["--deep-rounds", str(args.rounds)] if args.rounds else []
        argv += ["--backend", args.backend] if args.backend else []
        return zero2.main(argv + (["--configs", args.impls] if args.impls else []))
    if args.async_checkpoint:
        from oss_plus.bench import async_ckpt

        return async_ckpt.main(_async_argv(args))
    if args.ddp:
        from oss_plus.bench import ddp_bench

        return ddp_bench.main_from_args(args)
    if args.checkpoint:
        from oss_plus.bench import checkpoint_bench

        return checkpoint_bench.main_from_args(args)
    return _step_bench(args)


def _step_bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    out = Path(args.out)
    plot = "" if args.no_plot else f" and {out / 'bench.png'}"
    print(f"oss-plus bench: results go to {out / 'bench.json'}{plot}; progress on stderr")
    sys.stdout.flush()
    result = run(cfg, log=lambda line: say(f"{PREFIX} {line}"))
    report.to_json(result, out / "bench.json")
    print()
    print(summary_table(result, str(out / "bench.json")))
    if args.details:
        print("\n" + report.table(result) + "\n")
        print("\n".join(report.summary_lines(result)))
    for line in report.sweep_lines(result):
        print(line)
    for key, text in result.profiles.items():
        print(f"\ntorch.profiler, rank 0, 5 steps of {key}:\n{text}")
    if not args.no_plot:
        print(report.plot(result, out / "bench.png"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand to the ``oss-plus`` parser."""
    defaults = BenchConfig()
    bench = sub.add_parser(
        "bench",
        help="time oss_plus against fairscale OSS, torch ZeRO and references",
        description="Spawn local ranks and run oss_plus.OSS (fp32/bf16/fp16 wire), fairscale OSS, "
        "torch ZeRO (with and without parameters_as_bucket_view), the unsharded "
        "optimizer and the shard floor side by side: step time, wire bytes, "
        "optimizer state per rank, RSS, clip_grad_norm time. Peers that are not "
        "installed are skipped. By default the main rows, 3 rounds and their RSS (about a "
        "minute on 2 cores), then a summary; --full for every row and the size sweep.",
    )
    add = bench.add_argument
    add("--quick", action="store_true", help="one short round of the main rows")
    add(
        "--full",
        action="store_true",
        help="every row, the RSS of the main ones and the size sweep (several minutes)",
    )
    add("--details", action="store_true", help="also print the table of every column")
    add("--size", type=float, help=f"model size in M params (default {defaults.size:g})")
    add("--width", type=int, help=f"Linear width (default {defaults.width})")
    add("--world-size", type=int, help=f"ranks (default {defaults.world_size})")
    add(
        "--optimizer",
        help="adam, adam_fused, adamw, sgd or noop (an inner step that does nothing: what "
        f"each wrapper adds) (default {defaults.optimizer})",
    )
    add(
        "--tensors",
        type=int,
        help="split the model into this many equal tensors at the same --size (the host "
        "cost per tensor; default: Linear layers)",
    )
    add("--device", help="params on auto (the GPU under NCCL, else CPU), cpu or cuda")
    add("--steps", type=int, help=f"timed steps per round (default {defaults.steps})")
    add("--warmup", type=int, help=f"untimed steps per round (default {defaults.warmup})")
    add("--rounds", type=int, help=f"rounds, order rotated each round (default {defaults.rounds})")
    add(
        "--impls",
        help=f"comma-separated rows (default {','.join(defaults.impls)}; --full: all but "
        "oss_plus_again): " + ",".join(IMPLS),
    )
    add(
        "--sweep-sizes",
        help="model sizes (M) to sweep, '' for none (default none; --full: "
        + ",".join(f"{s:g}" for s in FULL_SWEEP_SIZES)
        + ")",
    )
    add("--sweep-worlds", help="world sizes to sweep, e.g. 1,2,4 (default none)")
    add("--sweep-impls", help="rows of the sweeps (default oss_plus,fairscale,torch_zero_bv,floor)")
    add("--backend", help="auto (NCCL with a GPU per rank, else gloo), gloo or nccl")
    add("--threads", type=int, help="intra-op threads per rank (default cores // ranks)")
    add("--profile", help="rows to profile with torch.profiler, e.g. oss_plus,fairscale")
    add("--memory-impls", help="rows whose RSS is measured (default: the main rows)")
    add("--blocks", action="store_true", help="time one row at a time (default: step by step)")
    add("--no-memory", action="store_true", help="skip the per-implementation RSS runs")
    add("--no-plot", action="store_true", help="do not draw bench.png")
    add("--out", default="bench-results", help="directory for bench.json and bench.png")
    add(
        "--ddp",
        action="store_true",
        help="time full DDP training iterations instead (forward, backward, step), with the "
        "step overlapped with backward against the other optimizers (oss_plus.bench.ddp_bench)",
    )
    add(
        "--checkpoint",
        action="store_true",
        help="time checkpoint save and load against fairscale, torch ZeRO and the disk floor "
        "instead (--size, --world-size, --rounds; --steps: saves per round; --impls from "
        "oss_plus.bench.checkpoint_bench.IMPLEMENTATIONS)",
    )
    add(
        "--zero2",
        action="store_true",
        help="time ShardedDataParallel (ZeRO-2) + OSS against DDP + OSS and fairscale's "
        "ShardedDDP: step time, peak gradient bytes and RSS per rank (--world-size, --steps, "
        "--width, --backend; --impls from oss_plus.bench.zero2.CONFIGS), then side by side on "
        "96 small layers (--rounds)",
    )
    add(
        "--async-checkpoint",
        action="store_true",
        help="time blocking and asynchronous saves against torch.distributed.checkpoint "
        "instead (--size, --world-size; --rounds: timed runs; oss_plus.bench.async_ckpt)",
    )
    add(
        "--state-memory",
        action="store_true",
        help="count the optimizer-state bytes per rank of low-bit optimizers (torchao "
        "AdamW8bit/4bit/Fp8, bitsandbytes Adam(W)8bit) under OSS against AdamW, sharded and "
        "unsharded, next to oss-plus plan's table (--impls from oss_plus.bench.state_memory."
        "OPTIMIZERS, default adamw,adamw8bit,bnb-adamw8bit; --sweep-worlds, default 2,4; "
        "--width of the transformer-like model, default 256)",
    )
    bench.set_defaults(func=_run)
