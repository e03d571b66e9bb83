"""Accelerate with ``oss_plus.OSS`` written as the plain optimizer (issue 56).

No ``collective_state_dict=True``. ``prepare(optimizer)`` wraps it in ``AcceleratedOptimizer``,
whose ``__init__`` calls ``state_dict()`` then ``load_state_dict()`` on every process before
any step (device placement, ``accelerate/optimizer.py``); ``save_state`` calls
``state_dict()`` on every process and the main process writes it
(``accelerate/checkpointing.py``, ``save_accelerator_state``); ``load_state`` calls
``load_state_dict()`` on every process. ``accelerate_recipe.py`` is the explicit form.
Run: ``torchrun --nproc_per_node 2 accelerate_no_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate_recipe import train
from common import EPOCHS, LR, args, dataset, dump, full_state, tiny_model
from torch.utils.data import DataLoader

from oss_plus import OSS


def build(accelerator: Accelerator, sharded: bool = True):
    model = tiny_model()
    if sharded:
        optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # the unsharded reference
    loader = DataLoader(dataset(), batch_size=4)
    return accelerator.prepare(model, optimizer, loader)


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
        accelerator.save_state(ckpt_dir)
    else:
        model, optimizer, loader = build(accelerator)
        accelerator.load_state(ckpt_dir)
        train(accelerator, model, optimizer, loader, EPOCHS - 1)
        full = full_state(optimizer.optimizer)  # the OSS inside Accelerate's wrapper
        dump(f"{out}/resumed.safetensors", accelerator.unwrap_model(model), full)
    accelerator.end_training()


if __name__ == "__main__":
    main()
