"""The DCP rows of the checkpoint bench (:mod:`oss_plus.bench.checkpoint_bench`).

* ``oss_plus dcp``: ``OSS`` through torch's flow, ``get_optimizer_state_dict`` then
  ``dcp.save``; loading is a fresh ``OSS``, ``get_optimizer_state_dict`` (the template),
  ``dcp.load`` and ``set_optimizer_state_dict``. Each rank holds and writes only its own
  state.
* ``DDP + Adam dcp``: the same calls for the plain ``torch.optim.Adam`` every DDP rank holds
  (its whole state on every rank; DCP's planner spreads the writes of the replicated tensors
  over the ranks).

Both use ``FileSystemWriter`` with its default ``sync_files=True`` (fsync, like oss_plus's
own saves). :func:`rank_bytes` counts what each rank wrote.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

#: The DCP implementations of the checkpoint bench.
IMPLEMENTATIONS = ("oss_plus dcp", "DDP + Adam dcp")


def optimizer(impl: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``impl`` checkpoints."""
    if impl == "DDP + Adam dcp":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    from oss_plus import OSS

    return OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)


def save(opt: Any, model: torch.nn.Module, path: str) -> None:
    """``get_optimizer_state_dict`` then ``dcp.save`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():  # torch warns that the bench saves over its last save
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save(state, checkpoint_id=path)


def load(opt: Any, model: torch.nn.Module, path: str) -> None:
    """The template, ``dcp.load``, ``set_optimizer_state_dict`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])


def rank_bytes(impl: str, path: str, rank: int) -> int:
    """Bytes of the data files rank ``rank`` wrote under ``path`` (DCP: ``__R_*.distcp``;
    oss_plus sharded: its shard; the disk floor: its file; the single-writer saves: every
    file, on rank 0)."""
    if impl.endswith("dcp"):
        pattern = f"__{rank}_*.distcp"
    elif impl == "oss_plus sharded":
        pattern = f"shard-{rank:05d}-of-*"
    elif impl.startswith("disk floor"):
        pattern = f"floor-{rank}-*"
    elif rank == 0:
        pattern = "*"
    else:
        return 0
    return sum(f.stat().st_size for f in Path(path).glob(pattern) if f.is_file())
