"""Local ranks on this machine: a free port, the process group, and a spawn-and-collect runner.

The one place that starts ``torch.distributed`` on 127.0.0.1: the demo, the benchmarks and the
test pool (:mod:`oss_plus.testing`) all join their groups through :func:`init_local_group`.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oss_plus.runtime import dist as _dist

#: Seconds a collective of :func:`run_local`'s ranks may wait before giving up (a hung peer).
PG_TIMEOUT_S = 300.0


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pick_backend(requested: str, world_size: int) -> str:
    """Return ``"nccl"`` when asked for (or ``"auto"`` with a GPU per rank), else ``"gloo"``.

    Raises:
        ValueError: NCCL was requested but there are fewer GPUs than ranks.
    """
    gpus = visible_gpus()
    if requested == "nccl" and gpus < world_size:
        raise ValueError(
            f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPU(s); "
            "use --backend gloo"
        )
    if requested == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    return requested


#: The values of the examples' and the demo's ``--device`` flag.
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceChoice:
    """Where one local rank runs: its device, the backend of its process group, and a
    one-line note when GPUs exist but too few for the local ranks (empty otherwise)."""

    device: torch.device
    backend: str
    note: str = ""


def visible_gpus() -> int:
    """Return how many CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(
    requested: str, local_rank: int, local_world_size: int, gpus: int | None = None
) -> DeviceChoice:
    """Pick a local rank's device the way torchrun scripts do.

    ``auto``: ``cuda:local_rank`` with NCCL when every local rank has its own GPU; with fewer
    GPUs than local ranks, every rank falls back to gloo on the CPU (all ranks decide alike,
    so the group gets one backend) and :attr:`DeviceChoice.note` says so. ``cpu`` and
    ``cuda`` force the choice.

    Args:
        requested: ``"auto"``, ``"cpu"`` or ``"cuda"`` (the ``--device`` flag).
        local_rank: this process's rank on its machine (torchrun's ``LOCAL_RANK``).
        local_world_size: the ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``).
        gpus: the CUDA devices this process sees (default: :func:`visible_gpus`).

    Raises:
        ValueError: an unknown ``requested``, or ``cuda`` with fewer GPUs than local ranks.

    Example:
        >>> choose_device("auto", 1, 2, gpus=2).device
        device(type='cuda', index=1)
        >>> choice = choose_device("auto", 1, 2, gpus=1)
        >>> choice.device, choice.backend
        (device(type='cpu'), 'gloo')
    """
    if requested not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    gpus = visible_gpus() if gpus is None else gpus
    enough = gpus >= local_world_size
    if requested == "cuda" and not enough:
        raise ValueError(
            f"--device cuda needs one GPU per local rank: {local_world_size} local rank(s), "
            f"{gpus} GPU(s); use --device cpu or fewer ranks"
        )
    if requested == "cpu" or not enough:
        note = ""
        if requested == "auto" and gpus > 0:
            note = (
                f"{gpus} GPU(s) for {local_world_size} local ranks: every rank runs on the CPU "
                "with gloo (one GPU per local rank is needed for NCCL; --device to choose)"
            )
        return DeviceChoice(torch.device("cpu"), "gloo", note)
    return DeviceChoice(torch.device("cuda", local_rank), "nccl")


def threads_per_rank(requested: int, world_size: int) -> int:
    """Return the intra-op threads of each rank: ``requested``, or cores // ranks (>= 1)."""
    return requested if requested > 0 else max(1, (os.cpu_count() or 1) // world_size)


def init_local_group(
    rank: int, world_size: int, port: int, backend: str = "gloo", timeout_s: float = PG_TIMEOUT_S
) -> None:
    """Join the default process group of ``world_size`` local ranks (TCP store on ``port``)."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def serve_store(timeout_s: float = PG_TIMEOUT_S) -> dist.TCPStore:
    """Serve a TCP store from this process on a port the kernel picks while binding it.

    Local ranks join it as clients (:func:`join_local_group`). A port found free and bound
    later by rank 0 (:func:`free_port`) leaves a window in which another process can take
    it. Here the port is bound from the start.
    """
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def join_local_group(
    rank: int, world_size: int, port: int, backend: str = "gloo", timeout_s: float = PG_TIMEOUT_S
) -> None:
    """Join the default process group of ``world_size`` local ranks through the store
    another process serves on ``port`` (:func:`serve_store`)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


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
    join_local_group(rank, world, port, backend)
    try:
        result = fn(rank, world, *args)
    except Exception:  # noqa: BLE001 - shipped to the parent, re-raised there
        queue.put((rank, False, traceback.format_exc()))
        raise
    else:
        queue.put((rank, True, result))
        if backend == "gloo":
            _drain()
    finally:
        dist.destroy_process_group()


def _drain() -> None:
    """End a rank with one collective that returns only once gloo's workers let go of it.

    ``fn``'s last collective may be one whose tensors gloo's worker drops after ``wait()``
    returned (torch's own, or a plain ``dist.all_gather`` of the bench); if the process is
    exiting by then, the drop takes the GIL and the process aborts ("terminate called
    without an active exception", docs/reliability.md, "Process exit"). Earlier collectives
    have completed on every rank before this one can, so their workers are done with them.
    """
    flag = torch.zeros(1)
    with _dist.released(dist.group.WORLD, flag):
        dist.all_reduce(flag)


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` freshly spawned local ranks.

    Each call starts new processes, so memory figures (RSS, peak RSS) start clean.

    Args:
        fn: A module-level function (it is pickled by reference into the children).
        world_size: Number of ranks.
        *args: Passed to ``fn`` after the rank and world size (picklable).
        backend: ``"gloo"`` or ``"nccl"`` (rank ``r`` then uses GPU ``r``).
        threads: Intra-op threads per rank; 0 for cores // ranks.

    Returns:
        The return values, ordered by rank.

    Raises:
        RuntimeError: A rank raised (its traceback is in the message).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store = serve_store()  # served until the ranks are done: no port to lose meanwhile
    spec = (world_size, store.port, backend, threads_per_rank(threads, world_size))
    results: dict[int, Any] = {}
    try:
        context = mp.start_processes(
            _entry,
            args=(*spec, fn, args, queue),
            nprocs=world_size,
            start_method="spawn",
            join=False,
        )
        # read while the ranks run: a result larger than the pipe's buffer (64 KB) blocks
        # its rank in put() until it is read, and that rank would never exit
        while not context.join(timeout=0.1):
            _collect(queue, results)
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"a local rank failed:\n{exc}") from None
    _collect(queue, results)
    return [results[r] for r in range(world_size)]


def _collect(queue: Any, results: dict[int, Any]) -> None:
    """Move every result waiting in ``queue`` into ``results``; raise a rank's failure."""
    while not queue.empty():
        rank, ok, value = queue.get()
        if not ok:
            raise RuntimeError(f"local rank {rank} failed:\n{value}")
        results[rank] = value
