"""Shared set-up for the examples: process group, device and a small model.

Run any example with ``torchrun --nproc_per_node 2 examples/<name>.py``: on CPU it uses gloo,
on a machine with GPUs it uses NCCL and one GPU per rank, unchanged.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def setup() -> torch.device:
    """Initialise the process group from torchrun's environment; return this rank's device."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def model(device: torch.device, width: int = 128) -> torch.nn.Module:
    """The same small MLP on every rank (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    ).to(device)


def batch(step: int, device: torch.device, width: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A different batch per rank and step (so DDP's averaging matters)."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(32, width, generator=gen)
    return x.to(device), x[:, :1].sin().to(device)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    return p


def log(message: str) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(message, flush=True)
