"""The implementations the checkpoint bench compares: each one's optimizer, save and load.

:mod:`oss_plus.bench.checkpoint_bench` times them; every one runs on the same model (ten
square linear layers, Adam):

* ``fairscale``: ``consolidate_state_dict(recipient_rank=0)`` then ``torch.save`` on rank 0;
  loading is ``torch.load`` + ``load_state_dict`` on every rank;
* ``torch ZeRO``: ``consolidate_state_dict(to=0)`` then ``torch.save`` on rank 0; same load;
* ``oss_plus torch.save``: oss_plus's ``consolidate_state_dict(recipient_rank=0)`` then
  ``torch.save`` on rank 0, the same flow and file as fairscale's (issue 45's measure of the
  consolidation); same load;
* ``oss_plus sharded`` / ``oss_plus consolidated``: ``save_checkpoint(sharded=...)`` and
  ``load_checkpoint``. These fsync every file before committing; ``torch.save`` does not.
* ``oss_plus dcp`` / ``DDP + Adam dcp``: ``torch.distributed.checkpoint``'s flow
  (:mod:`oss_plus.bench.dcp_ckpt`), for ``OSS`` and for the plain Adam every DDP rank holds;
* ``disk floor sharded`` / ``disk floor consolidated``: no format, no checksum, no index, no
  communication: each rank (sharded) or rank 0 alone, for every rank's bytes (consolidated),
  writes the raw bytes of the optimizer state to a new file with ``os.write`` (starting the
  writeback of every 16 MB at once), fsyncs it and unlinks the previous one. That is what
  any durable save of these bytes must do at least, so it bounds how much faster than
  fairscale a save that fsyncs can be on this disk. Its load is not measured.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.bench import dcp_ckpt

__all__ = [
    "CHUNK",
    "IMPLEMENTATIONS",
    "available",
    "build_model",
    "build_optimizer",
    "load",
    "save",
]

IMPLEMENTATIONS = (
    "fairscale",
    "torch ZeRO",
    "oss_plus torch.save",
    "oss_plus sharded",
    "oss_plus consolidated",
    *dcp_ckpt.IMPLEMENTATIONS,
    "disk floor sharded",
    "disk floor consolidated",
)


def build_model(params_m: float) -> torch.nn.Module:
    """Ten square linear layers holding about ``params_m`` million params."""
    width = int((params_m * 1e6 / 10) ** 0.5)
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(10)])


def build_optimizer(impl: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if impl in dcp_ckpt.IMPLEMENTATIONS:
        return dcp_ckpt.optimizer(impl, model)
    if impl == "fairscale":
        from fairscale.optim import OSS as FairscaleOSS

        return FairscaleOSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
    if impl == "torch ZeRO":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
        )
    return OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)


#: The disk floor writes in pieces of this size and starts each one's writeback at once, as
#: oss_plus does (without that, the final fsync waits for every byte: measured slower).
CHUNK = 16 << 20


def floor_save(opt: Any, path: str, rank: int, sharded: bool) -> None:
    """Write the state's raw bytes to a new file, fsync it, unlink the previous one."""
    tensors = [v for s in opt.optim.state.values() for v in s.values() if torch.is_tensor(v)]
    if not sharded:
        tensors = tensors * dist.get_world_size() if rank == 0 else []  # rank 0 writes all
    os.makedirs(path, exist_ok=True)
    previous = list(Path(path).glob(f"floor-{rank}-*"))
    if tensors:
        _write_durably(os.path.join(path, f"floor-{rank}-{time.monotonic_ns()}"), tensors)
    dist.barrier()  # like a commit: the previous files go once every rank's bytes are durable
    for file in previous:
        file.unlink()


def _write_durably(file: str, tensors: list[torch.Tensor]) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_CREAT)
    try:
        done = 0
        for tensor in tensors:
            data = tensor.detach().contiguous().view(-1).numpy().data.cast("B")
            while data:
                n = os.write(fd, data[:CHUNK])
                os.posix_fadvise(fd, done, n, os.POSIX_FADV_DONTNEED)  # start writeback now
                data, done = data[n:], done + n
        os.fsync(fd)
    finally:
        os.close(fd)


def save(impl: str, opt: Any, path: str, rank: int, model: torch.nn.Module) -> None:
    if impl in dcp_ckpt.IMPLEMENTATIONS:
        dcp_ckpt.save(opt, model, path)
        return
    if impl.startswith("disk floor"):
        floor_save(opt, path, rank, impl.endswith("sharded"))
        return
    if impl in ("oss_plus sharded", "oss_plus consolidated"):
        save_checkpoint(opt, path, sharded=impl.endswith("sharded"))
        return
    start = time.perf_counter()
    if impl in ("fairscale", "oss_plus torch.save"):
        opt.consolidate_state_dict(recipient_rank=0)
    else:
        opt.consolidate_state_dict(to=0)
    if rank == 0:
        consolidated = time.perf_counter()
        os.makedirs(path, exist_ok=True)
        torch.save(opt.state_dict(), os.path.join(path, "optim.pt"))
        PHASES.append((consolidated - start, time.perf_counter() - consolidated))


#: Rank 0's (consolidation, ``torch.save``) seconds of every consolidate-then-``torch.save``
#: save this process made, in order (the benchmark splits the flow's time with them).
PHASES: list[tuple[float, float]] = []


def load(impl: str, opt: Any, path: str, model: torch.nn.Module) -> None:
    if impl in dcp_ckpt.IMPLEMENTATIONS:
        dcp_ckpt.load(opt, model, path)
    elif impl in ("oss_plus sharded", "oss_plus consolidated"):
        load_checkpoint(opt, path)
    else:
        file = os.path.join(path, "optim.pt")
        opt.load_state_dict(torch.load(file, weights_only=True))


def available(impl: str) -> str | None:
    """Return why ``impl`` cannot run here, or None."""
    if impl == "fairscale" and importlib.util.find_spec("fairscale") is None:
        return "fairscale is not installed (pip install fairscale==0.4.13)"
    if impl.startswith("disk floor") and importlib.util.find_spec("numpy") is None:
        return "numpy is not installed (the floor writes tensor bytes through numpy)"
    return None
