"""Ignite's ``Checkpoint`` with ``oss_plus.OSS`` written as the plain optimizer (issue 56).

No ``collective_state_dict=True``: ``OSS`` is not torch's ``ZeroRedundancyOptimizer``, so
``Checkpoint`` calls its ``state_dict()`` on every rank at each save, with no
``consolidate_state_dict()`` before (``ignite/handlers/checkpoint.py``,
``Checkpoint._setup_checkpoint``), and ``DiskSaver`` writes rank 0's result.
``ignite_recipe.py`` is the explicit form.
Run: ``torchrun --nproc_per_node 2 ignite_no_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import EPOCHS, LR, args, dataset, dump, full_state, tiny_model
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from oss_plus import OSS


def build(sharded: bool = True):
    model = DDP(tiny_model())
    if sharded:
        optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # the unsharded reference
    trainer = create_supervised_trainer(model, optimizer, torch.nn.functional.mse_loss)
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    return model, optimizer, trainer, loader


def main() -> None:
    phase, out = args()
    dist.init_process_group("gloo")
    ckpt_dir = os.path.join(out, "ckpt")
    if phase == "train":
        model, optimizer, trainer, loader = build(sharded=False)
        trainer.run(loader, max_epochs=EPOCHS)
        dump(f"{out}/reference.safetensors", model.module, optimizer.state_dict())
        model, optimizer, trainer, loader = build()
        to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
        saver = DiskSaver(ckpt_dir, require_empty=False)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, saver, n_saved=None))
        trainer.run(loader, max_epochs=1)
    else:
        model, optimizer, trainer, loader = build()
        to_load = {"model": model, "optimizer": optimizer, "trainer": trainer}
        path = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1])
        Checkpoint.load_objects(to_load, torch.load(path, map_location="cpu", weights_only=True))
        trainer.run(loader, max_epochs=EPOCHS)
        dump(f"{out}/resumed.safetensors", model.module, full_state(optimizer))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
