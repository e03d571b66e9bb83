"""Shared set-up for the examples: process group, device and a small model.

Run any example with ``torchrun --nproc_per_node 2 examples/<name>.py``. Each local rank
takes ``cuda:LOCAL_RANK`` under NCCL when the machine has a GPU per local rank; with fewer
GPUs (or none), every rank runs on the CPU under gloo, and rank 0 says so in one line when
some GPUs were too few. ``--device cpu`` or ``--device cuda`` overrides the choice.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from oss_plus import choose_device


def setup(requested: str = "auto") -> torch.device:
    """Initialise the process group from torchrun's environment; return this rank's device."""
    choice = choose_device(
        requested,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )
    if choice.note and int(os.environ.get("RANK", 0)) == 0:
        print(choice.note, flush=True)
    if choice.device.type == "cuda":
        torch.cuda.set_device(choice.device)
    dist.init_process_group(choice.backend)
    return choice.device


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
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda:LOCAL_RANK with NCCL when there is a GPU per local rank, else gloo on "
        "the CPU (default); cpu; cuda",
    )
    return p


def log(message: str) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(message, flush=True)
