"""Checkpoint save/load, side by side: oss_plus against fairscale OSS and torch ZeRO.

Run it with ``oss-plus bench --checkpoint`` or ``python -m oss_plus.bench.checkpoint_bench``
(``--help`` for options).

Every implementation runs in its own freshly spawned group of gloo ranks (so memory freed by
one never flatters another), on the same model (default: 20M params, Adam, 2 ranks).
:mod:`oss_plus.bench.checkpoint_impls` describes each implementation and runs its saves
and loads: fairscale and torch ZeRO consolidating to rank 0, oss_plus's two layouts, the
DCP flow, and the disk floors that bound how fast any save that fsyncs can be.

Times are wall-clock from a barrier before to a barrier after the call (the slowest rank
counts); "save CPU" is the CPU time (user + system, every thread) all ranks spent in that
window, a cost that other jobs on a shared machine do not inflate. Both are the median over
``--rounds`` rounds of ``--reps`` runs; the rounds visit the implementations in rotating
order, so a noisy moment on a shared machine does not land on one implementation only. Each
process first makes one untimed warm-up save (one-time costs). Peak RSS is sampled by a
thread every 10 ms; the ratio is the largest peak seen during any save, warm-up included,
over the RSS just before the first save (steady state: model, grads, optimizer state), the
largest over the ranks.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.bench import dcp_ckpt
from oss_plus.bench.checkpoint_impls import (
    IMPLEMENTATIONS,
    PHASES,
    available,
    build_model,
    build_optimizer,
    load,
    save,
)
from oss_plus.bench.measure import PeakRSS, rss
from oss_plus.runtime.launch import run_local

#: Each oss_plus layout and the disk floor it is compared with.
FLOORS = {
    "oss_plus sharded": "disk floor sharded",
    "oss_plus consolidated": "disk floor consolidated",
}
#: The implementation the targets are measured against.
BASELINE = "fairscale"
#: oss_plus's consolidate + torch.save, the same flow as the baseline's (issue 45's measure).
SAME_FLOW = "oss_plus torch.save"


def _timed(fn: Callable[[], None]) -> tuple[float, int, float]:
    """Run ``fn`` between two barriers; return (seconds, peak RSS bytes, CPU seconds)."""
    with PeakRSS() as peak:
        dist.barrier()
        cpu = time.process_time()
        start = time.perf_counter()
        fn()
        dist.barrier()
        elapsed = time.perf_counter() - start
        used = time.process_time() - cpu
    return elapsed, peak.peak, used


def _rank_main(
    rank: int, world: int, impl: str, params_m: float, reps: int, root: str
) -> dict[str, Any]:
    model = build_model(params_m)
    opt = build_optimizer(impl, model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    steady = rss()
    path = os.path.join(root, impl.replace(" ", "_"))
    saves = []
    for _ in range(reps + 1):  # the first is a warm-up: its time is not counted, its RSS is
        saves.append(_timed(functools.partial(save, impl, opt, path, rank, model)))
    warmup, saves = saves[0], saves[1:]
    phases = PHASES[1:]  # rank 0's split of the timed saves (the warm-up's dropped)
    dist.barrier()  # every rank has removed its share of the replaced files
    size = sum(f.stat().st_size for f in Path(path).iterdir()) if rank == 0 else 0
    written = dcp_ckpt.rank_bytes(impl, path, rank)
    del opt
    gc.collect()
    loads = []
    for _ in range(0 if impl.startswith("disk floor") else reps):
        fresh = build_optimizer(impl, model)
        before = rss()
        seconds, peak, _ = _timed(functools.partial(load, impl, fresh, path, model))
        loads.append((seconds, peak - before))
        del fresh
        gc.collect()
    return {
        "save_s": [s for s, _, _ in saves],
        "save_cpu": [c for _, _, c in saves],
        "load_s": [s for s, _ in loads],
        "steady": steady,
        "save_peak": max(p for _, p, _ in [warmup, *saves]),
        "load_extra": max((e for _, e in loads), default=0),
        "bytes": size,
        "rank_bytes": written,
        "params": sum(p.numel() for p in model.parameters()),
        "phases": phases,
    }


def _summarize(ranks_per_run: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Median over every run of every round; memory: the worst rank of the worst run."""
    saves = [
        max(r["save_s"][i] for r in ranks)
        for ranks in ranks_per_run
        for i in range(len(ranks[0]["save_s"]))
    ]
    loads = [
        max(r["load_s"][i] for r in ranks)
        for ranks in ranks_per_run
        for i in range(len(ranks[0]["load_s"]))
    ]
    cpu = [
        sum(r["save_cpu"][i] for r in ranks)
        for ranks in ranks_per_run
        for i in range(len(ranks[0]["save_cpu"]))
    ]
    every = [r for ranks in ranks_per_run for r in ranks]
    phases = [p for ranks in ranks_per_run for p in ranks[0].get("phases", [])]
    split = {}
    if phases:
        split = {
            "consolidate_s": statistics.median(c for c, _ in phases),
            "torch_save_s": statistics.median(t for _, t in phases),
        }
    return {
        **split,
        "save_s": statistics.median(saves),
        "save_runs": saves,
        "save_cpu_s": statistics.median(cpu),
        "load_s": statistics.median(loads) if loads else None,
        "load_runs": loads,
        "save_rss_ratio": max(r["save_peak"] / r["steady"] for r in every),
        "steady_mb": max(r["steady"] for r in every) / 1e6,
        "load_extra_mb": max(r["load_extra"] for r in every) / 1e6,
        "size_mb": ranks_per_run[0][0]["bytes"] / 1e6,
        "rank_mb": [r.get("rank_bytes", 0) / 1e6 for r in ranks_per_run[0]],
        "params": every[0]["params"],
    }


def run(
    params_m: float, world: int, reps: int, rounds: int, impls: tuple[str, ...]
) -> dict[str, Any]:
    """Measure every implementation in ``rounds`` rounds (rotating the order, so a noisy
    moment on a shared machine does not hit one implementation only); return the summary."""
    skipped = {impl: reason for impl in impls if (reason := available(impl))}
    for impl, reason in skipped.items():
        print(f"skipping {impl}: {reason}", file=sys.stderr)
    todo = [impl for impl in impls if impl not in skipped]
    runs: dict[str, list[list[dict[str, Any]]]] = {impl: [] for impl in todo}
    root = tempfile.mkdtemp(prefix="oss_plus_ckpt_bench_")
    try:
        for round_ in range(rounds):
            for impl in todo[round_ % len(todo) :] + todo[: round_ % len(todo)]:
                print(f"round {round_ + 1}/{rounds}: {impl} ...", file=sys.stderr, flush=True)
                runs[impl].append(run_local(_rank_main, world, impl, params_m, reps, root))
                shutil.rmtree(os.path.join(root, impl.replace(" ", "_")), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        impl: _summarize(runs[impl]) if impl in runs else {"skipped": skipped[impl]}
        for impl in impls
    }
    return summary


def _ratio(base: dict[str, Any], m: dict[str, Any], key: str) -> str:
    return f"{base[key] / m[key]:.1f}x" if key in base and m.get(key) else "n/a"


def table(summary: dict[str, Any]) -> str:
    """Return the summary as a Markdown table with the ratios to the baseline (fairscale).

    ``best`` is the fastest run: on a shared machine, the closest to the uncontended cost.
    """
    for m in summary.values():
        if "save_runs" in m:
            m.setdefault("save_best", min(m["save_runs"]))
    base = summary.get(BASELINE, {})
    lines = [
        "| implementation | save, median (s) | vs fairscale | save, best (s) | vs fairscale "
        "| save CPU, all ranks (s) | vs fairscale | load (s) | peak RSS during save / steady "
        "| extra RSS during load | on disk | written per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for impl, m in summary.items():
        if "skipped" in m:
            lines.append(f"| {impl} | skipped: {m['skipped']} |" + " |" * 10)
            continue
        lines.append(
            f"| {impl} | {m['save_s']:.3f} | {_ratio(base, m, 'save_s')} | "
            f"{m['save_best']:.3f} | {_ratio(base, m, 'save_best')} | "
            f"{m['save_cpu_s']:.3f} | {_ratio(base, m, 'save_cpu_s')} | "
            f"{'-' if m['load_s'] is None else format(m['load_s'], '.3f')} | "
            f"{m['save_rss_ratio']:.2f}x (steady {m['steady_mb']:.0f} MB) | "
            f"{m['load_extra_mb']:.0f} MB | {m['size_mb']:.0f} MB | "
            f"{' / '.join(f'{x:.1f}' for x in m.get('rank_mb', []))} MB |"
        )
    lines += ["", *same_flow_lines(summary), *floor_lines(summary)]
    return "\n".join(lines)


def same_flow_lines(summary: dict[str, Any]) -> list[str]:
    """oss_plus's consolidate + ``torch.save`` over the baseline's, the same flow, this run."""
    m, base = summary.get(SAME_FLOW, {}), summary.get(BASELINE, {})
    if "save_s" not in m or "save_s" not in base:
        return []
    lines = [
        f"{SAME_FLOW}: {m['save_s'] / base['save_s']:.2f}x {BASELINE}'s save time (median), "
        f"{m['save_best'] / base['save_best']:.2f}x (best), consolidate_state_dict(0) + "
        "torch.save on rank 0 in both"
    ]
    if "consolidate_s" in m and "consolidate_s" in base:
        floor = m["torch_save_s"] / (base["consolidate_s"] + base["torch_save_s"])
        lines.append(
            f"  on rank 0 (medians): consolidate_state_dict {m['consolidate_s'] * 1e3:.0f} ms "
            f"against {base['consolidate_s'] * 1e3:.0f} ms "
            f"({m['consolidate_s'] / base['consolidate_s']:.2f}x), torch.save "
            f"{m['torch_save_s'] * 1e3:.0f} ms against {base['torch_save_s'] * 1e3:.0f} ms; "
            f"with no consolidation at all the flow would be {floor:.2f}x"
        )
    return lines


def floor_lines(summary: dict[str, Any]) -> list[str]:
    """Each oss_plus layout against its disk floor, and the floor against the baseline."""
    base = summary.get(BASELINE, {})
    out = []
    for impl, floor in FLOORS.items():
        m, f = summary.get(impl, {}), summary.get(floor, {})
        if "save_s" not in m or "save_s" not in f:
            continue
        line = f"{impl}: save {m['save_s'] / f['save_s']:.2f}x its disk floor (median)"
        if "save_s" in base:
            line += (
                f"; the floor itself is {base['save_s'] / f['save_s']:.1f}x faster than "
                f"{BASELINE} (median), so no save that fsyncs these bytes beats {BASELINE} by "
                "more on this disk"
            )
        out.append(line)
    return out


def _report(
    params_m: float, world: int, reps: int, rounds: int, impls: tuple[str, ...], out: str | None
) -> int:
    """Run, print the table, write the summary to the JSON file ``out`` (when given)."""
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    summary = run(params_m, world, reps, rounds, impls)
    params = next((m["params"] for m in summary.values() if "params" in m), 0)
    print(
        f"\n{params / 1e6:.1f}M params, Adam, {world} gloo ranks, "
        f"{os.cpu_count()} cores, median of {rounds} rounds x {reps} runs; "
        f"load average before the run: {load}\n"
    )
    print(table(summary))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=1))
        print(f"results: {out}")
    return 0


def main_from_args(args: argparse.Namespace) -> int:
    """``oss-plus bench --checkpoint``: the bench's flags mapped onto this benchmark's.

    ``--size`` is ``--params``, ``--steps`` is ``--reps``, ``--impls`` is ``--only`` (comma
    separated), and the summary goes to ``checkpoint_bench.json`` under ``--out``.

    Raises:
        ValueError: an unknown implementation.
    """
    impls = tuple(x.strip() for x in (args.impls or "").split(",") if x.strip())
    unknown = [x for x in impls if x not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(
            f"unknown --impls {unknown} for --checkpoint: choose from {list(IMPLEMENTATIONS)}"
        )
    quick = bool(getattr(args, "quick", False))
    return _report(
        args.size or 20.0,
        args.world_size or 2,
        args.steps or (1 if quick else 3),
        args.rounds or (1 if quick else 2),
        impls or IMPLEMENTATIONS,
        str(Path(args.out) / "checkpoint_bench.json"),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m oss_plus.bench.checkpoint_bench``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=20.0, help="model size, millions")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="saves and loads per round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds over all implementations, in rotating order"
    )
    parser.add_argument("--only", nargs="*", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--json", help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    return _report(
        args.params, args.world_size, args.reps, args.rounds, tuple(args.only), args.json
    )


if __name__ == "__main__":
    sys.exit(main())
