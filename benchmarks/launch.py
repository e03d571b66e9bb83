"""Run a function on N local ranks (gloo, or NCCL with one GPU per rank) and collect results."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds a collective may wait before the process group gives up (a hung peer).
PG_TIMEOUT = 300


def pick_backend(requested: str, world_size: int) -> str:
    """Return ``"nccl"`` when asked for (or ``"auto"`` with a GPU per rank), else ``"gloo"``.

    Raises:
        ValueError: NCCL was requested but there are fewer GPUs than ranks.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl" and gpus < world_size:
        raise ValueError(
            f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPU(s); "
            "use --backend gloo"
        )
    if requested == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    return requested


def threads_per_rank(requested: int, world_size: int) -> int:
    """Return the intra-op threads of each rank: ``requested``, or cores // ranks (>= 1)."""
    return requested if requested > 0 else max(1, (os.cpu_count() or 1) // world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    backend: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT),
    )
    try:
        queue.put((rank, True, fn(rank, world, *args)))
    except Exception:  # noqa: BLE001 - shipped to the parent, re-raised there
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, backend: str, threads: int, *args: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on fresh spawned ranks; return results by rank.

    Each call starts new processes, so memory figures (RSS, peak RSS) start clean.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _entry,
            args=(world_size, _free_port(), backend, threads, fn, args, queue),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"a benchmark rank failed:\n{exc}") from None
    results: dict[int, Any] = {}
    while not queue.empty():
        rank, ok, value = queue.get()
        if not ok:
            raise RuntimeError(f"benchmark rank {rank} failed:\n{value}")
        results[rank] = value
    return [results[r] for r in range(world_size)]
