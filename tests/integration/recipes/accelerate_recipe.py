"""Accelerate: ``prepare``, ``save_state`` and ``load_state`` with ``oss_plus.OSS``.

``prepare(optimizer)`` and ``save_state`` call ``state_dict()`` on every process: the
optimizer takes ``collective_state_dict=True`` and consolidates by itself there. The model is
saved with safetensors (``model.safetensors``) although its params live in sync buckets.
Run: ``torchrun --nproc_per_node 2 accelerate_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from common import EPOCHS, LR, args, dataset, dump, tiny_model
from torch.utils.data import DataLoader

from oss_plus import OSS


# [recipe]
def build(accelerator: Accelerator, sharded: bool = True):
    model = tiny_model()
    if sharded:
        optimizer = OSS(
            model.parameters(), optim=torch.optim.Adam, lr=LR, collective_state_dict=True
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # the unsharded reference
    loader = DataLoader(dataset(), batch_size=4)
    return accelerator.prepare(model, optimizer, loader)


def train(accelerator: Accelerator, model, optimizer, loader, epochs: int) -> None:
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()


# [/recipe]


def main() -> None:
    phase, out = args()
    accelerator = Accelerator(cpu=True)
    ckpt_dir = os.path.join(out, "ckpt")
    if phase == "train":
        model, optimizer, loader = build(accelerator, sharded=False)
        train(accelerator, model, optimizer, loader, EPOCHS)
        dump(
            f"{out}/reference.safetensors", accelerator.unwrap_model(model), optimizer.state_dict()
        )
        accelerator = Accelerator(cpu=True)  # its own list of objects to save
        model, optimizer, loader = build(accelerator)
        train(accelerator, model, optimizer, loader, 1)
        accelerator.save_state(ckpt_dir)  # every process calls optimizer.state_dict()
    else:
        model, optimizer, loader = build(accelerator)
        accelerator.load_state(ckpt_dir)
        train(accelerator, model, optimizer, loader, EPOCHS - 1)
        full = optimizer.state_dict()  # collective: the full state on every process
        dump(f"{out}/resumed.safetensors", accelerator.unwrap_model(model), full)
    accelerator.end_training()


if __name__ == "__main__":
    main()
