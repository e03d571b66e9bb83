"""The step benchmark: every implementation side by side on the same ranks and model.

Three measurements, each in fresh spawned ranks:

* timing: all implementations in one set of ranks, in ``rounds`` rounds in varying orders
  (:func:`oss_plus.bench.step_ranks.orders`: every position, varying neighbours, so a
  noisy neighbour or the row before hits every row alike); each round builds the row
  from a fresh copy of the model, runs ``warmup`` steps, then times ``steps`` steps. A step's
  time is the slowest rank's (barrier before, ``all_reduce(MAX)`` after, both untimed); on
  CUDA the span of CUDA events around it. Also recorded: the host time of a step (until
  ``step()`` returned), device-to-host syncs of one untimed step (``set_sync_debug_mode`` on
  CUDA, host reads elsewhere), the device memory a step peaks at over steady (CUDA),
  optimizer-state bytes per rank, wire bytes per step, clip_grad_norm time.
  ``tensors`` splits the model into that many equal tensors at the same total size (the
  host cost per tensor), and ``--optimizer noop`` (an inner step that does nothing) leaves
  only what each wrapper adds.
* memory: one fresh set of ranks per implementation: steady-state RSS after
  ``memory_steps`` steps and peak RSS (``ru_maxrss``) of each rank.
* sweeps: step time of a few rows against model size and against world size.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from oss_plus.bench.impls import IMPLS
from oss_plus.bench.progress import Progress
from oss_plus.bench.step_config import (
    BenchConfig,
)
from oss_plus.bench.step_ranks import memory_rank, profile_rank, timing_rank
from oss_plus.runtime.launch import pick_backend, run_local, threads_per_rank

#: Rows whose RSS is measured by default (the transport variants share oss_plus's layout).
MEMORY_IMPLS = (
    "oss_plus",
    "oss_plus_bf16",
    "fairscale",
    "fairscale_fp16",
    "torch_zero",
    "torch_zero_bv",
    "unsharded",
    "floor",
)


@dataclass
class BenchResult:
    """Everything one invocation measured (plain data, JSON-ready)."""

    config: dict[str, Any]
    machine: dict[str, Any]
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    size_sweep: dict[str, dict[str, float]] = field(default_factory=dict)
    profiles: dict[str, str] = field(default_factory=dict)
    world_sweep: dict[str, dict[str, float]] = field(default_factory=dict)


def _available(keys: tuple[str, ...], skipped: dict[str, str]) -> list[str]:
    ok = []
    for key in keys:
        reason = IMPLS[key].missing()
        if reason:
            skipped[key] = reason
        else:
            ok.append(key)
    return ok


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    times = sorted(row["times"])
    return {
        "step_s": statistics.median(times),
        "host_s": statistics.median(row["host"]) if row.get("host") else None,
        "syncs": row.get("syncs"),
        "peak_over_steady": row.get("peak"),
        "step_p10_s": times[len(times) // 10],
        "step_p90_s": times[(len(times) * 9) // 10],
        "clip_s": statistics.median(row["clip"]) if row["clip"] else None,
        "cpu_s": statistics.median(row["cpu"]) if row["cpu"] else None,
        "busy_cores": statistics.median(c / t for c, t in zip(row["cpu"], row["times"]) if t)
        if row["cpu"]
        else None,
        "state_bytes": row["state"],
        "main_bytes": row.get("main"),
        "compressed_numel": row.get("compressed"),
        "wire_bytes": row["wire"],
        "note": row["note"],
        "times_s": row["times"],
        "state_imbalance": max(row["state"]) / statistics.mean(row["state"])
        if any(row["state"])
        else None,
    }


def _on_ranks(cfg: BenchConfig, fn: Any, world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` fresh ranks with ``cfg``'s backend and threads."""
    backend = pick_backend(cfg.backend, world)
    return run_local(fn, world, *args, backend=backend, threads=cfg.threads)


def phases_ahead(cfg: BenchConfig, keys: list[str]) -> dict[str, str]:
    """Each phase ``cfg`` runs, in order, and what it is in a few words (for the progress)."""
    memory = [
        k for k in keys if k in (MEMORY_IMPLS if cfg.memory_impls is None else cfg.memory_impls)
    ]
    sizes = [s for s in cfg.sweep_sizes if s != cfg.size]
    ahead = {"timing": f"timing ({len(keys)} rows x {cfg.rounds} rounds)"}
    if cfg.memory and memory:
        ahead["memory"] = f"memory ({len(memory)} rows, fresh ranks each)"
    if sizes:
        ahead["size sweep"] = "size sweep (" + ", ".join(f"{s:g}" for s in sizes) + "M params)"
    if cfg.sweep_worlds:
        ahead["world sweep"] = f"world-size sweep ({', '.join(map(str, cfg.sweep_worlds))} ranks)"
    if cfg.profile:
        ahead["profile"] = f"profiles ({', '.join(cfg.profile)})"
    return ahead


def _then(ahead: dict[str, str], phase: str) -> str:
    """What runs after ``phase``: the phases that follow it in ``ahead``."""
    names = list(ahead)
    later = names[names.index(phase) + 1 :] if phase in ahead else []
    if not later:
        return ""
    more = f" and {len(later) - 1} more" if len(later) > 1 else ""
    return ahead[later[0]] + more


def _timing(
    cfg: BenchConfig, result: BenchResult, keys: list[str], log: Any, then: str = ""
) -> None:
    backend, threads = result.machine["backend"], result.machine["threads_per_rank"]
    log(
        f"timing {len(keys)} implementations: {cfg.size:g}M params, {cfg.world_size} ranks "
        f"({backend}, {threads} thread(s) each), {cfg.rounds} rounds x {cfg.steps} steps"
    )
    progress = Progress("timing", 0, then)  # its total: counted by the ranks
    timed = _on_ranks(cfg, timing_rank, cfg.world_size, cfg, keys, [cfg.size], progress)[0]
    result.rows = {k: _summary(v) for k, v in timed[str(cfg.size)].items()}
    result.machine["timing_mode"] = timed[f"mode {cfg.size}"]


def _memory(cfg: BenchConfig, result: BenchResult, keys: list[str], then: str = "") -> None:
    chosen = MEMORY_IMPLS if cfg.memory_impls is None else cfg.memory_impls
    measured = [k for k in keys if k in chosen]
    ticker = Progress("memory", len(measured), then).start()
    for key in measured:
        result.rows[key]["rss"] = _on_ranks(cfg, memory_rank, cfg.world_size, cfg, key)
        ticker.tick(f"RSS of {key} (fresh ranks)")


def _sweeps(cfg: BenchConfig, result: BenchResult, log: Any, ahead: dict[str, str]) -> None:
    keys = _available(cfg.sweep_impls, {})
    sweep_cfg = replace(cfg, rounds=max(1, cfg.rounds - 1))
    sizes = [s for s in cfg.sweep_sizes if s != cfg.size]
    if sizes:
        log(f"size sweep {sizes}M params: {keys}")
        progress = Progress("size sweep", 0, _then(ahead, "size sweep"))
        args = (sweep_cfg, keys, sizes, progress)
        swept = _on_ranks(cfg, timing_rank, cfg.world_size, *args)[0]
        for size in sizes:
            result.size_sweep[str(size)] = {
                k: v["step_s"] for k, v in ((k, _summary(v)) for k, v in swept[str(size)].items())
            }
    if cfg.sweep_sizes and cfg.size in cfg.sweep_sizes:  # the main run is that point
        result.size_sweep[str(cfg.size)] = {
            k: result.rows[k]["step_s"] for k in keys if k in result.rows
        }
        result.size_sweep = dict(sorted(result.size_sweep.items(), key=lambda kv: float(kv[0])))
    ticker = Progress("world sweep", len(cfg.sweep_worlds), _then(ahead, "world sweep")).start()
    for world in cfg.sweep_worlds:
        world_cfg = replace(sweep_cfg, world_size=world)
        swept = _on_ranks(cfg, timing_rank, world, world_cfg, keys, [cfg.size])[0]
        result.world_sweep[str(world)] = {
            k: _summary(v)["step_s"] for k, v in swept[str(cfg.size)].items()
        }
        ticker.tick(f"{world} rank(s), {cfg.size:g}M params, rows {keys}")


def _profile(cfg: BenchConfig, result: BenchResult, log: Any) -> None:
    for key in _available(cfg.profile, {}):
        log(f"profiling: {key}")
        result.profiles[key] = _on_ranks(cfg, profile_rank, cfg.world_size, cfg, key)[0]


def run(cfg: BenchConfig, log: Any = print) -> BenchResult:
    """Run the benchmark described by ``cfg``; ``log`` receives progress lines.

    Returns:
        The measurements (see :class:`BenchResult`).

    Raises:
        ValueError: NCCL requested without a GPU per rank.
        RuntimeError: a rank failed.
    """
    started = time.perf_counter()
    backend = pick_backend(cfg.backend, cfg.world_size)
    result = BenchResult(
        asdict(cfg),
        {
            "cores": os.cpu_count(),
            "backend": backend,
            "threads_per_rank": threads_per_rank(cfg.threads, cfg.world_size),
            "torch": torch.__version__,
            "load_before": os.getloadavg(),
        },
    )
    keys = _available(cfg.impls, result.skipped)
    for reason in sorted(set(result.skipped.values())):
        log(f"skipping {[k for k, r in result.skipped.items() if r == reason]}: {reason}")
    ahead = phases_ahead(cfg, keys)
    log("phases: " + ", ".join(ahead.values()))
    phases = {"timing": lambda: _timing(cfg, result, keys, log, _then(ahead, "timing"))}
    if cfg.memory:
        phases["memory"] = lambda: _memory(cfg, result, keys, _then(ahead, "memory"))
    phases["sweeps"] = lambda: _sweeps(cfg, result, log, ahead)
    if cfg.profile:
        phases["profile"] = lambda: _profile(cfg, result, log)
    durations = {}
    for name, phase in phases.items():
        begin = time.perf_counter()
        phase()
        durations[name] = round(time.perf_counter() - begin, 1)
    result.machine.update(
        load_after=os.getloadavg(),
        phase_seconds=durations,
        total_seconds=round(time.perf_counter() - started, 1),
    )
    return result
