"""Asynchronous checkpoints against blocking ones and torch.distributed.checkpoint (DCP).

Run: ``python -m oss_plus.bench.async_ckpt`` (``--help`` for options). One spawned group of
gloo ranks (default: 2 ranks, 20M-param Adam model, the checkpoint bench's model) measures,
in one run, with a barrier before and after every timed call (the slowest rank counts):

* ``oss_plus blocking save``: ``save_checkpoint(sharded=True)`` (fsynced, committed);
* ``oss_plus async stall``: the time ``save_checkpoint(blocking=False)`` blocks the caller
  (validation, the snapshot into staging, the save id); then the step time while that save
  is in flight against a quiet step (forward, backward, ``step``) and the peak RSS during
  it against the steady RSS, with the staging bytes stated;
* ``DCP save``: ``torch.distributed.checkpoint.save`` of the same per-rank tensors with
  ``FileSystemWriter`` (``sync_files=True``, its default); ``DCP async_save stall``: the
  time ``async_save`` blocks the caller;
* loads at another world size (1 rank reading what 2 ranks wrote, the same bytes):
  ``load_checkpoint`` of the sharded checkpoint against DCP's ``load`` (resharding).

Each number is the median over ``--reps`` runs after one untimed warm-up.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.bench.measure import PeakRSS, rss
from oss_plus.checkpoint import staging_nbytes
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.launch import run_local

__all__ = ["main", "run"]


def _model(params_m: float) -> torch.nn.Module:
    width = int((params_m * 1e6 / 10) ** 0.5)
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(10)])


def _step(model: torch.nn.Module, opt: OSS) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    width = next(model.parameters()).shape[1]
    model(torch.ones(8, width)).sum().backward()
    opt.step()
    return time.perf_counter() - start


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed


def _tensors(opt: OSS) -> dict[str, torch.Tensor]:
    """This rank's state tensors under global names (what DCP saves)."""
    return {
        f"{i}.{k}": v
        for i, s in opt.export_local_state().items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }


def _all_done(future: Any) -> bool:
    """True once the save of every rank is done (one tiny all_reduce on the default group).

    A rank must not decide alone to stop stepping: ``OSS.step`` is collective, and a rank
    whose own save finished first would wait in the next collective while the others step.
    """
    flag = torch.tensor([int(future.done())], dtype=torch.int32)
    with _dist.released(dist.group.WORLD, flag):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _save_side(rank: int, world: int, params_m: float, reps: int, root: str) -> dict[str, Any]:
    model = _model(params_m)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
    quiet = [_step(model, opt) for _ in range(reps + 3)][1:]
    ours, stall, busy, theirs, their_stall = [], [], [], [], []
    steady = peak = 0
    dcp_group = dist.new_group(backend="gloo")  # async_save's collectives run in its thread
    for rep in range(reps + 1):
        ours.append(_timed(lambda: save_checkpoint(opt, f"{root}/ours")))
        future: Any = None

        def start() -> None:
            nonlocal future
            future = save_checkpoint(opt, f"{root}/ours_async", blocking=False)

        steady = max(steady, rss())
        with PeakRSS(interval=0.005) as peak_rss:
            stall.append(_timed(start))
            while not _all_done(future):  # every rank steps as often: steps are collective
                busy.append(_step(model, opt))
            future.result()
        peak = max(peak, peak_rss.peak)
        dist.barrier()
        tensors = _tensors(opt)
        writer = dcp.FileSystemWriter(f"{root}/dcp", sync_files=True)
        theirs.append(_timed(functools.partial(dcp.save, tensors, storage_writer=writer)))
        pending: list[Any] = []
        writer = dcp.FileSystemWriter(f"{root}/dcp_async", sync_files=True)
        start_dcp = functools.partial(
            dcp.async_save, tensors, storage_writer=writer, process_group=dcp_group
        )
        their_stall.append(_timed(lambda: pending.append(start_dcp())))  # noqa: B023
        pending[0].result()
        if rep == 0:  # warm-up
            ours, stall, busy, theirs, their_stall = [], [], [], [], []
    return {
        "quiet_step": quiet,
        "busy_step": busy,
        "blocking": ours,
        "stall": stall,
        "dcp_save": theirs,
        "dcp_stall": their_stall,
        "steady_rss": steady,
        "peak_rss": peak,
        "staging": staging_nbytes(opt),
        "shapes": {k: [list(v.shape), str(v.dtype)] for k, v in _tensors(opt).items()},
    }


def _load_side(
    rank: int, world: int, params_m: float, reps: int, root: str, shapes: dict[str, Any]
) -> dict[str, Any]:
    model = _model(params_m)
    ours, theirs = [], []
    for _ in range(reps + 1):
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
        ours.append(_timed(functools.partial(load_checkpoint, opt, f"{root}/ours")))
        target = {
            k: torch.empty(s, dtype=getattr(torch, d.split(".")[1])) for k, (s, d) in shapes.items()
        }
        theirs.append(_timed(functools.partial(dcp.load, target, checkpoint_id=f"{root}/dcp")))
        del opt, target
    return {"ours": ours[1:], "dcp": theirs[1:]}


def run(params_m: float, world: int, reps: int) -> dict[str, Any]:
    """Measure everything; return the medians (seconds, bytes)."""
    root = tempfile.mkdtemp(prefix="oss_plus_async_bench_")
    try:
        saved = run_local(_save_side, world, params_m, reps, root)
        shapes = {k: v for r in saved for k, v in r["shapes"].items()}
        loaded = run_local(_load_side, 1, params_m, reps, root, shapes)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def slowest(key: str) -> float:
        runs = len(saved[0][key])
        return statistics.median(max(r[key][i] for r in saved) for i in range(runs))

    return {
        "params_m": params_m,
        "world": world,
        "blocking_save_s": slowest("blocking"),
        "async_stall_s": slowest("stall"),
        "quiet_step_s": statistics.median(s for r in saved for s in r["quiet_step"]),
        "busy_step_s": statistics.median(s for r in saved for s in r["busy_step"]),
        "dcp_save_s": slowest("dcp_save"),
        "dcp_async_stall_s": slowest("dcp_stall"),
        "steady_rss_mb": max(r["steady_rss"] for r in saved) / 1e6,
        "peak_rss_mb": max(r["peak_rss"] for r in saved) / 1e6,
        "staging_mb": max(r["staging"] for r in saved) / 1e6,
        "load_1_rank_s": statistics.median(loaded["ours"]),
        "dcp_load_1_rank_s": statistics.median(loaded["dcp"]),
    }


def table(m: dict[str, Any]) -> str:
    """The rows of the checkpoint bench for asynchronous saves and DCP (markdown)."""
    rows = [
        ("blocking save (sharded, fsynced)", m["blocking_save_s"], m["dcp_save_s"]),
        ("stall of an async save", m["async_stall_s"], m["dcp_async_stall_s"]),
        ("load on 1 rank of a 2-rank save", m["load_1_rank_s"], m["dcp_load_1_rank_s"]),
    ]
    lines = ["| | oss_plus | DCP | oss_plus / DCP |", "|---|---|---|---|"]
    lines += [f"| {name} | {a:.3f} s | {b:.3f} s | {a / b:.2f}x |" for name, a, b in rows]
    lines += [
        "",
        f"stall / blocking save: {m['async_stall_s'] / m['blocking_save_s']:.2f}x; step while a "
        f"save is in flight: {m['busy_step_s']:.3f} s vs quiet {m['quiet_step_s']:.3f} s "
        f"({m['busy_step_s'] / m['quiet_step_s']:.2f}x); peak RSS during an async save "
        f"{m['peak_rss_mb']:.0f} MB vs steady {m['steady_rss_mb']:.0f} MB "
        f"({m['peak_rss_mb'] / m['steady_rss_mb']:.2f}x; staging {m['staging_mb']:.0f} MB)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print the table (``--json`` for the raw numbers)."""
    parser = argparse.ArgumentParser(prog="python -m oss_plus.bench.async_ckpt")
    parser.add_argument("--params-m", type=float, default=20.0, help="model size, millions")
    parser.add_argument("--world", type=int, default=2, help="ranks that save")
    parser.add_argument("--reps", type=int, default=3, help="timed runs after a warm-up")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    args = parser.parse_args(argv)
    measured = run(args.params_m, args.world, args.reps)
    print(json.dumps(measured, indent=1) if args.json else table(measured))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
