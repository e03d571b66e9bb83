"""What every recipe shares: the tiny model, the data, and the dump the test compares.

Each recipe runs twice under ``torchrun --nproc_per_node 2`` (gloo, CPU):

* ``train OUT``: an unsharded reference run (the plain ``torch.optim.Adam``, the same
  framework, every epoch) dumped to ``OUT/reference.safetensors``; then the sharded run for
  the first epoch, saved through the framework's own checkpointing under ``OUT/ckpt``.
* ``resume OUT``: fresh processes load that checkpoint through the framework, train the
  last epoch and dump to ``OUT/resumed.safetensors``.

The test then requires both dumps to be equal, parameters and optimizer state, exactly.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

EPOCHS = 2
LR = 0.01


def tiny_model() -> torch.nn.Sequential:
    """The same small MLP on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def dataset(samples: int = 32) -> TensorDataset:
    """Regression data, the same on every rank (a sampler splits it)."""
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(samples, 8, generator=generator), torch.randn(samples, 1, generator=generator)
    )


def args() -> tuple[str, str]:
    """Return (phase, output directory) from the command line."""
    phase, out = sys.argv[1], sys.argv[2]
    if phase not in ("train", "resume"):
        raise SystemExit(f"usage: {sys.argv[0]} train|resume OUT")
    return phase, out


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def dump(path: str, model: torch.nn.Module, optimizer_state: dict[str, Any] | None) -> None:
    """Write the params and the full optimizer state as one safetensors file (rank 0)."""
    if rank() != 0:
        return
    if optimizer_state is None:
        raise RuntimeError("rank 0 needs the full optimizer state to dump")
    tensors = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().clone()
    save_file(tensors, path)


#: What both Lightning recipes give their ``Trainer`` besides strategy, epochs and callbacks.
LIGHTNING_TRAINER = {
    "accelerator": "cpu",
    "devices": 2,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def full_state(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The full optimizer state on rank 0 (a sharded one is consolidated on every rank)."""
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict()
        return optimizer.state_dict() if rank() == 0 else None
    return optimizer.state_dict()
