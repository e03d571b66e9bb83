"""The step benchmark on every rank: build the rows, time their steps, measure their memory.

The functions named ``*_rank`` run on each spawned rank (see :mod:`oss_plus.bench.step_bench`,
which launches them and summarizes what rank 0 returns).
"""

from __future__ import annotations

import functools
import gc
import os
import resource
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oss_plus.bench.impls import IMPLS, Runner
from oss_plus.bench.measure import device, rss, synchronize, timed

if TYPE_CHECKING:
    from oss_plus.bench.step_bench import BenchConfig

#: max_norm used when timing clip_grad_norm: large, so the grads are left unchanged.
CLIP_NORM = 1e9


def make_params(cfg: BenchConfig, layers: int) -> list[torch.nn.Parameter]:
    """The model: ``layers`` x Linear(width, width) params with fixed grads, on this rank."""
    gen = torch.Generator().manual_seed(cfg.seed)
    where = device()
    params = []
    for _ in range(layers):
        for shape in ((cfg.width, cfg.width), (cfg.width,)):
            p = torch.nn.Parameter(((torch.rand(shape, generator=gen) - 0.5) * 0.1).to(where))
            p.grad = ((torch.rand(shape, generator=gen) - 0.5) * 1e-3).to(where)
            params.append(p)
    return params


def _measure(runner: Runner, slowest: torch.Tensor, warmup: int, steps: int) -> dict[str, Any]:
    for _ in range(warmup):
        runner.step()
    cpu: list[float] = []
    times = timed(runner.step, steps, slowest, cpu)
    clip = timed(functools.partial(runner.clip, CLIP_NORM), 3, slowest) if runner.clip else []
    states = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(states, torch.tensor([float(runner.state_bytes())], dtype=torch.float64))
    return {
        "times": times,
        "cpu": cpu,
        "clip": clip,
        "state": [int(s) for s in states],
        "wire": runner.wire_bytes,
        "note": runner.note,
    }


def _warm_up(cfg: BenchConfig, layers: int) -> None:
    """Grow the heap once (unsharded optimizer, largest model) so that no row pays for it."""
    runner = IMPLS["unsharded"].build(make_params(cfg, layers), cfg.optimizer)
    for _ in range(2):
        runner.step()
    del runner
    gc.collect()


def _fits_interleaved(cfg: BenchConfig, keys: list[str], size: float) -> bool:
    """Whether every row can be alive at once: params + grads + (at most) Adam state each."""
    per_row = cfg.layers(size) * (cfg.width * cfg.width + cfg.width) * 4 * 4
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return per_row * len(keys) * dist.get_world_size() < 0.5 * total


def _interleaved(cfg: BenchConfig, keys: list[str], size: float, slowest: torch.Tensor) -> dict:
    """Every row alive at once, one step of each in turn (order rotated every cycle): a noisy
    neighbour slows every row alike."""
    runners = {k: IMPLS[k].build(make_params(cfg, cfg.layers(size)), cfg.optimizer) for k in keys}
    for _ in range(cfg.warmup):
        for runner in runners.values():
            runner.step()
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    for cycle in range(cfg.rounds * cfg.steps):
        for key in keys[cycle % len(keys) :] + keys[: cycle % len(keys)]:
            times[key] += timed(runners[key].step, 1, slowest, cpu[key])
    rows = {}
    for key, runner in runners.items():
        rows[key] = _measure(runner, slowest, 0, 0)
        rows[key]["times"], rows[key]["cpu"] = times[key], cpu[key]
    return rows


def _blocks(cfg: BenchConfig, keys: list[str], size: float, slowest: torch.Tensor) -> dict:
    """One row at a time, built fresh for each of ``rounds`` rounds (order rotated)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in range(cfg.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            runner = IMPLS[key].build(make_params(cfg, cfg.layers(size)), cfg.optimizer)
            result = _measure(runner, slowest, cfg.warmup, cfg.steps)
            row = rows.setdefault(key, {**result, "times": [], "cpu": [], "clip": []})
            row["times"] += result["times"]
            row["cpu"] += result["cpu"]
            row["clip"] += result["clip"]
            del runner
            gc.collect()
    return rows


def timing_rank(
    rank: int, world: int, cfg: BenchConfig, keys: list[str], sizes: list[float]
) -> dict[str, Any]:
    """Time every row of ``keys`` at every size in ``sizes`` (rank 0's result is used).

    Rows are interleaved step by step when they all fit in memory, else run in blocks.
    """
    slowest = torch.zeros(1, dtype=torch.float64, device=device())
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    _warm_up(cfg, cfg.layers(max(sizes)))
    for size in sizes:
        fits = cfg.interleave and _fits_interleaved(cfg, keys, size)
        out[f"mode {size}"] = "interleaved" if fits else "blocks"
        out[str(size)] = (_interleaved if fits else _blocks)(cfg, keys, size, slowest)
        gc.collect()
    return out


def profile_rank(rank: int, world: int, cfg: BenchConfig, key: str, steps: int = 5) -> str:
    """Profile ``steps`` steps of one row with torch.profiler; rank 0 returns the op table."""
    runner = IMPLS[key].build(make_params(cfg, cfg.layers()), cfg.optimizer)
    for _ in range(cfg.warmup + 1):
        runner.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step()
    if rank != 0:
        return ""
    return str(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40)
    )


def memory_rank(rank: int, world: int, cfg: BenchConfig, key: str) -> dict[str, int]:
    """Steady-state and peak RSS of this rank for one row, in a fresh process."""
    base = rss()
    params = make_params(cfg, cfg.layers())
    model = rss()
    runner = IMPLS[key].build(params, cfg.optimizer)
    for _ in range(cfg.memory_steps):
        runner.step()
    gc.collect()
    synchronize()
    steady = rss()
    peak = max(steady, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"base": base, "model": model, "steady": steady, "peak": peak}
