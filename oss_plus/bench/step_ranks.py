"""The step benchmark on every rank: build the rows, time their steps, measure their memory.

The functions named ``*_rank`` run on each spawned rank (see :mod:`oss_plus.bench.step_bench`,
which launches them and summarizes what rank 0 returns).
"""

from __future__ import annotations

import functools
import gc
import os
import random
import resource
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.bench.impls import IMPLS, Runner
from oss_plus.bench.measure import (
    comm_device,
    count_syncs,
    device,
    peak_over_steady,
    rss,
    synchronize,
    timed,
)
from oss_plus.bench.progress import Progress, Ticker
from oss_plus.bench.step_config import BenchConfig
from oss_plus.runtime import dist as _dist

#: max_norm used when timing clip_grad_norm: large, so the grads are left unchanged.
CLIP_NORM = 1e9


def make_params(cfg: BenchConfig, size: float) -> list[torch.nn.Parameter]:
    """The model of ``size`` M params with fixed grads, on this rank's device: a stack of
    Linear(width, width) layers, or ``cfg.tensors`` equal 1-D tensors (``--tensors``)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    where = device(cfg.device)
    if cfg.tensors:
        shapes: list[tuple[int, ...]] = [(cfg.tensor_numel(size),)] * cfg.tensors
    else:
        shapes = [(cfg.width, cfg.width), (cfg.width,)] * cfg.layers(size)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(((torch.rand(shape, generator=gen) - 0.5) * 0.1).to(where))
        p.grad = ((torch.rand(shape, generator=gen) - 0.5) * 1e-3).to(where)
        params.append(p)
    return params


def _measure(
    runner: Runner, slowest: torch.Tensor, warmup: int, steps: int, on: torch.device
) -> dict[str, Any]:
    """Time a row's steps (and clip), then count one step's device-to-host syncs and its
    device memory peak, untimed; gather every rank's state bytes and syncs."""
    for _ in range(warmup):
        runner.step()
    cpu: list[float] = []
    host: list[float] = []
    times = timed(runner.step, steps, slowest, cpu, host)
    clip = timed(functools.partial(runner.clip, CLIP_NORM), 3, slowest) if runner.clip else []
    syncs = count_syncs(runner.step, on)  # untimed: counting slows the step
    peak = peak_over_steady(runner.step, on)
    comm = comm_device()  # NCCL takes no CPU tensor, gloo takes any
    main = runner.main() if runner.main is not None else (0, 0)
    numbers = [float(runner.state_bytes()), float(syncs), float(main[0]), float(main[1])]
    mine = torch.tensor(numbers, dtype=torch.float64)
    rows = [torch.zeros(4, dtype=torch.float64, device=comm) for _ in range(dist.get_world_size())]
    mine = mine.to(comm)
    with _dist.released(dist.group.WORLD, mine, *rows):  # may be a rank's last collective
        dist.all_gather(rows, mine)
    gathered = torch.stack(rows).tolist()
    return {
        "times": times,
        "host": host,
        "cpu": cpu,
        "clip": clip,
        "state": [int(r[0]) for r in gathered],
        "syncs": max(int(r[1]) for r in gathered),
        "main": [int(r[2]) for r in gathered],
        "compressed": [int(r[3]) for r in gathered],
        "peak": peak,
        "wire": runner.wire_bytes,
        "note": runner.note,
    }


def _warm_up(cfg: BenchConfig, size: float) -> None:
    """Grow the heap once (unsharded optimizer, largest model) so that no row pays for it."""
    runner = IMPLS["unsharded"].build(make_params(cfg, size), cfg.optimizer)
    for _ in range(2):
        runner.step()
    del runner
    gc.collect()


def _fits_interleaved(cfg: BenchConfig, keys: list[str], size: float) -> bool:
    """Whether every row can be alive at once: params + grads + (at most) Adam state each."""
    per_row = cfg.numel(size) * 4 * 4
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return per_row * len(keys) * dist.get_world_size() < 0.5 * total


def orders(keys: list[str], count: int, seed: int) -> list[list[str]]:
    """``count`` orders of ``keys``, the same on every rank: a rotation each (every row at
    every position), the rotations of odd ones reversed (so that a row does not always run
    right after the same row, as it does under rotation alone), in a seeded shuffled
    sequence.

    Example:
        >>> orders(["a", "b", "c"], 6, 0)[:3]
        [['a', 'c', 'b'], ['c', 'a', 'b'], ['b', 'c', 'a']]
    """
    n = len(keys)
    made = [keys[i % n :] + keys[: i % n] for i in range(count)]
    made = [order[::-1] if (i // n) % 2 else order for i, order in enumerate(made)]
    random.Random(seed).shuffle(made)
    return made


def _interleaved(
    cfg: BenchConfig, keys: list[str], size: float, slowest: torch.Tensor, ticker: Ticker | None
) -> dict:
    """Every row alive at once, one step of each in turn (:func:`orders`): a noisy neighbour
    slows every row alike. ``ticker`` (rank 0's) ticks after each round of ``steps`` steps."""
    runners = {k: IMPLS[k].build(make_params(cfg, size), cfg.optimizer) for k in keys}
    for _ in range(cfg.warmup):
        for runner in runners.values():
            runner.step()
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    host: dict[str, list[float]] = {k: [] for k in keys}
    if ticker is not None:
        ticker.ready()
    for i, order in enumerate(orders(keys, cfg.rounds * cfg.steps, cfg.seed), 1):
        for key in order:
            times[key] += timed(runners[key].step, 1, slowest, cpu[key], host[key])
        if ticker is not None and i % cfg.steps == 0:
            ticker.tick(
                f"{size:g}M params, round {i // cfg.steps} of {cfg.rounds} "
                f"({len(keys)} rows x {cfg.steps} steps, interleaved)"
            )
    rows = {}
    for key, runner in runners.items():
        rows[key] = _measure(runner, slowest, 0, 0, device(cfg.device))
        rows[key].update(times=times[key], cpu=cpu[key], host=host[key])
    return rows


def _blocks(
    cfg: BenchConfig, keys: list[str], size: float, slowest: torch.Tensor, ticker: Ticker | None
) -> dict:
    """One row at a time, built fresh for each of ``rounds`` rounds (:func:`orders`);
    ``ticker`` (rank 0's) ticks after each row of each round."""
    rows: dict[str, dict[str, Any]] = {}
    for round_, order in enumerate(orders(keys, cfg.rounds, cfg.seed), 1):
        for key in order:
            runner = IMPLS[key].build(make_params(cfg, size), cfg.optimizer)
            result = _measure(runner, slowest, cfg.warmup, cfg.steps, device(cfg.device))
            row = rows.setdefault(key, {**result, "times": [], "cpu": [], "clip": [], "host": []})
            for series in ("times", "cpu", "clip", "host"):
                row[series] += result[series]
            del runner
            gc.collect()
            if ticker is not None:
                ticker.tick(f"{size:g}M params, round {round_} of {cfg.rounds}: {key}")
    return rows


def timing_rank(
    rank: int,
    world: int,
    cfg: BenchConfig,
    keys: list[str],
    sizes: list[float],
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Time every row of ``keys`` at every size in ``sizes`` (rank 0's result is used).

    Rows are interleaved step by step when they all fit in memory, else run in blocks.
    With ``progress``, rank 0 says on stderr after each round (each row of a round in
    blocks) how far the timing is (its ``total`` is counted here).
    """
    slowest = torch.zeros(1, dtype=torch.float64, device=comm_device())
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    fits = {size: cfg.interleave and _fits_interleaved(cfg, keys, size) for size in sizes}
    units = sum(cfg.rounds * (1 if fits[size] else len(keys)) for size in sizes)
    _warm_up(cfg, max(sizes))
    ticker = replace(progress, total=units).start() if progress and rank == 0 else None
    for size in sizes:
        out[f"mode {size}"] = "interleaved" if fits[size] else "blocks"
        run = _interleaved if fits[size] else _blocks
        out[str(size)] = run(cfg, keys, size, slowest, ticker)
        gc.collect()
    return out


def profile_rank(rank: int, world: int, cfg: BenchConfig, key: str, steps: int = 5) -> str:
    """Profile ``steps`` steps of one row with torch.profiler; rank 0 returns the op table."""
    runner = IMPLS[key].build(make_params(cfg, cfg.size), cfg.optimizer)
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
    params = make_params(cfg, cfg.size)
    model = rss()
    runner = IMPLS[key].build(params, cfg.optimizer)
    for _ in range(cfg.memory_steps):
        runner.step()
    gc.collect()
    synchronize()
    steady = rss()
    peak = max(steady, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"base": base, "model": model, "steady": steady, "peak": peak}
