"""The step benchmark: every implementation side by side on the same ranks and model.

Three measurements, each in fresh spawned ranks:

* timing: all implementations in one set of ranks, in ``rounds`` rounds with the order
  rotated each round (so a noisy neighbour hits every row alike); each round builds the row
  from a fresh copy of the model, runs ``warmup`` steps, then times ``steps`` steps. A step's
  time is the slowest rank's (barrier before, ``all_reduce(MAX)`` after, both untimed). Also
  recorded: optimizer-state bytes per rank, wire bytes per step, clip_grad_norm time.
* memory: one fresh set of ranks per implementation: steady-state RSS after
  ``memory_steps`` steps and peak RSS (``ru_maxrss``) of each rank.
* sweeps: step time of a few rows against model size and against world size.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.impls import IMPLS, OPTIMIZERS, Runner
from benchmarks.launch import pick_backend, run_ranks, threads_per_rank

#: Rows of the size / world-size sweeps (when available).
SWEEP_IMPLS = ("oss_plus", "fairscale", "torch_zero_bv", "floor")
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
#: max_norm used when timing clip_grad_norm: large, so the grads are left unchanged.
CLIP_NORM = 1e9


@dataclass(frozen=True)
class BenchConfig:
    """What to run. Sizes are in millions of parameters.

    Raises:
        ValueError: a value out of range or an unknown optimizer / implementation.
    """

    size: float = 20.0
    width: int = 1024
    world_size: int = 2
    optimizer: str = "adam"
    steps: int = 6
    warmup: int = 2
    rounds: int = 3
    memory_steps: int = 3
    impls: tuple[str, ...] = tuple(IMPLS)
    sweep_sizes: tuple[float, ...] = (5.0, 20.0, 50.0)
    sweep_worlds: tuple[int, ...] = ()
    sweep_impls: tuple[str, ...] = SWEEP_IMPLS
    memory: bool = True
    interleave: bool = True
    memory_impls: tuple[str, ...] | None = None
    profile: tuple[str, ...] = ()
    backend: str = "auto"
    threads: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        named = (*self.impls, *self.sweep_impls, *self.profile, *(self.memory_impls or ()))
        unknown = [k for k in named if k not in IMPLS]
        if unknown:
            raise ValueError(f"unknown implementation(s) {unknown}: choose from {list(IMPLS)}")
        for name in ("width", "world_size", "steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if (
            self.size <= 0
            or any(s <= 0 for s in self.sweep_sizes)
            or any(w < 1 for w in self.sweep_worlds)
        ):
            raise ValueError("sizes must be > 0 (millions of params) and world sizes >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")

    def layers(self, size: float | None = None) -> int:
        """Return how many Linear(width, width) layers make ``size`` million params (>= 1)."""
        per_layer = self.width * self.width + self.width
        return max(1, round((self.size if size is None else size) * 1e6 / per_layer))


# ---------------------------------------------------------------------- on every rank
def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_params(cfg: BenchConfig, layers: int) -> list[torch.nn.Parameter]:
    """The model: ``layers`` x Linear(width, width) params with fixed grads, on this rank."""
    gen = torch.Generator().manual_seed(cfg.seed)
    device = _device()
    params = []
    for _ in range(layers):
        for shape in ((cfg.width, cfg.width), (cfg.width,)):
            p = torch.nn.Parameter(((torch.rand(shape, generator=gen) - 0.5) * 0.1).to(device))
            p.grad = ((torch.rand(shape, generator=gen) - 0.5) * 1e-3).to(device)
            params.append(p)
    return params


def _sync() -> None:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def _timed(
    fn: Any, count: int, slowest: torch.Tensor, cpu: list[float] | None = None
) -> list[float]:
    """Time ``count`` calls of ``fn``; each is the slowest rank's time.

    With ``cpu``, also append the CPU time every rank spent in each call, summed over the
    ranks (user + system, every thread of the process, so gloo's threads and the kernel's
    copies for its sockets count): a step that keeps every core busy has ``cpu / time``
    equal to the number of cores.
    """
    times = []
    for _ in range(count):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        _sync()
        elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
        slowest.fill_(elapsed)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest))
        if cpu is not None:
            slowest.fill_(used)
            dist.all_reduce(slowest, op=dist.ReduceOp.SUM)
            cpu.append(float(slowest))
    return times


def _measure(runner: Runner, slowest: torch.Tensor, warmup: int, steps: int) -> dict[str, Any]:
    for _ in range(warmup):
        runner.step()
    cpu: list[float] = []
    times = _timed(runner.step, steps, slowest, cpu)
    clip = _timed(lambda: runner.clip(CLIP_NORM), 3, slowest) if runner.clip else []
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
            times[key] += _timed(runners[key].step, 1, slowest, cpu[key])
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
    slowest = torch.zeros(1, dtype=torch.float64, device=_device())
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


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_rank(rank: int, world: int, cfg: BenchConfig, key: str) -> dict[str, int]:
    """Steady-state and peak RSS of this rank for one row, in a fresh process."""
    base = _rss()
    params = make_params(cfg, cfg.layers())
    model = _rss()
    runner = IMPLS[key].build(params, cfg.optimizer)
    for _ in range(cfg.memory_steps):
        runner.step()
    gc.collect()
    _sync()
    steady = _rss()
    peak = max(steady, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"base": base, "model": model, "steady": steady, "peak": peak}


# ---------------------------------------------------------------------- orchestration
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
        "step_p10_s": times[len(times) // 10],
        "step_p90_s": times[(len(times) * 9) // 10],
        "clip_s": statistics.median(row["clip"]) if row["clip"] else None,
        "cpu_s": statistics.median(row["cpu"]) if row["cpu"] else None,
        "busy_cores": statistics.median(c / t for c, t in zip(row["cpu"], row["times"]) if t)
        if row["cpu"]
        else None,
        "state_bytes": row["state"],
        "wire_bytes": row["wire"],
        "note": row["note"],
        "times_s": row["times"],
        "state_imbalance": max(row["state"]) / statistics.mean(row["state"])
        if any(row["state"])
        else None,
    }


def _timing(cfg: BenchConfig, result: BenchResult, keys: list[str], log: Any) -> None:
    backend, threads = result.machine["backend"], result.machine["threads_per_rank"]
    log(
        f"timing {len(keys)} implementations: {cfg.size:g}M params, {cfg.world_size} ranks "
        f"({backend}, {threads} thread(s) each), {cfg.rounds} rounds x {cfg.steps} steps"
    )
    timed = run_ranks(timing_rank, cfg.world_size, backend, threads, cfg, keys, [cfg.size])[0]
    result.rows = {k: _summary(v) for k, v in timed[str(cfg.size)].items()}
    result.machine["timing_mode"] = timed[f"mode {cfg.size}"]


def _memory(cfg: BenchConfig, result: BenchResult, keys: list[str], log: Any) -> None:
    backend, threads = result.machine["backend"], result.machine["threads_per_rank"]
    chosen = MEMORY_IMPLS if cfg.memory_impls is None else cfg.memory_impls
    for key in [k for k in keys if k in chosen]:
        log(f"memory: {key} (fresh ranks)")
        result.rows[key]["rss"] = run_ranks(memory_rank, cfg.world_size, backend, threads, cfg, key)


def _sweeps(cfg: BenchConfig, result: BenchResult, log: Any) -> None:
    keys = _available(cfg.sweep_impls, {})
    sweep_cfg = replace(cfg, rounds=max(1, cfg.rounds - 1))
    sizes = [s for s in cfg.sweep_sizes if s != cfg.size]
    if sizes:
        log(f"size sweep {sizes}M params: {keys}")
        backend, threads = result.machine["backend"], result.machine["threads_per_rank"]
        swept = run_ranks(timing_rank, cfg.world_size, backend, threads, sweep_cfg, keys, sizes)[0]
        for size in sizes:
            result.size_sweep[str(size)] = {
                k: v["step_s"] for k, v in ((k, _summary(v)) for k, v in swept[str(size)].items())
            }
    if cfg.sweep_sizes and cfg.size in cfg.sweep_sizes:  # the main run is that point
        result.size_sweep[str(cfg.size)] = {
            k: result.rows[k]["step_s"] for k in keys if k in result.rows
        }
        result.size_sweep = dict(sorted(result.size_sweep.items(), key=lambda kv: float(kv[0])))
    for world in cfg.sweep_worlds:
        log(f"world-size sweep: {world} rank(s), {cfg.size:g}M params: {keys}")
        swept = run_ranks(
            timing_rank,
            world,
            pick_backend(cfg.backend, world),
            threads_per_rank(cfg.threads, world),
            replace(sweep_cfg, world_size=world),
            keys,
            [cfg.size],
        )[0]
        result.world_sweep[str(world)] = {
            k: _summary(v)["step_s"] for k, v in swept[str(cfg.size)].items()
        }


def _profile(cfg: BenchConfig, result: BenchResult, log: Any) -> None:
    backend, threads = result.machine["backend"], result.machine["threads_per_rank"]
    for key in _available(cfg.profile, {}):
        log(f"profiling: {key}")
        result.profiles[key] = run_ranks(profile_rank, cfg.world_size, backend, threads, cfg, key)[
            0
        ]


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
    phases = {"timing": lambda: _timing(cfg, result, keys, log)}
    if cfg.memory:
        phases["memory"] = lambda: _memory(cfg, result, keys, log)
    phases["sweeps"] = lambda: _sweeps(cfg, result, log)
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
