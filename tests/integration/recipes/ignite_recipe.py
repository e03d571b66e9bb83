"""Ignite: the ``Checkpoint`` handler with a sharded optimizer.

* ``oss_plus.compat.torch.ZeroRedundancyOptimizer`` passes Ignite's ``isinstance`` check for
  torch's class, so ``Checkpoint`` consolidates it on the saving rank, as for torch's own;
* ``oss_plus.OSS`` (or the fairscale adapter) takes ``collective_state_dict=True``: Ignite
  calls ``state_dict()`` on every rank, which then consolidates by itself.

``RECIPE_OPTIMIZER=torch|oss``.
Run: ``torchrun --nproc_per_node 2 ignite_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import EPOCHS, LR, args, dataset, dump, tiny_model
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from oss_plus import OSS
from oss_plus.compat.torch import ZeroRedundancyOptimizer


# [recipe]
def build(kind: str):
    model = DDP(tiny_model())
    if kind == "torch":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    elif kind == "oss":
        optimizer = OSS(
            model.parameters(), optim=torch.optim.Adam, lr=LR, collective_state_dict=True
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # the unsharded reference
    trainer = create_supervised_trainer(model, optimizer, torch.nn.functional.mse_loss)
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    return model, optimizer, trainer, loader


def train_and_save(kind: str, ckpt_dir: str) -> None:
    model, optimizer, trainer, loader = build(kind)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    saver = DiskSaver(ckpt_dir, require_empty=False)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, saver, n_saved=None))
    trainer.run(loader, max_epochs=1)


def resume(kind: str, ckpt_dir: str):
    model, optimizer, trainer, loader = build(kind)
    to_load = {"model": model, "optimizer": optimizer, "trainer": trainer}
    path = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1])
    Checkpoint.load_objects(to_load, torch.load(path, map_location="cpu", weights_only=True))
    trainer.run(loader, max_epochs=EPOCHS)
    return model, optimizer


# [/recipe]


def main() -> None:
    phase, out = args()
    kind = os.environ.get("RECIPE_OPTIMIZER", "torch")
    dist.init_process_group("gloo")
    ckpt_dir = os.path.join(out, "ckpt")
    if phase == "train":
        model, optimizer, trainer, loader = build("reference")
        trainer.run(loader, max_epochs=EPOCHS)
        dump(f"{out}/reference.safetensors", model.module, optimizer.state_dict())
        train_and_save(kind, ckpt_dir)
    else:
        model, optimizer = resume(kind, ckpt_dir)
        optimizer.consolidate_state_dict(0)
        full = optimizer.state_dict() if dist.get_rank() == 0 else None
        dump(f"{out}/resumed.safetensors", model.module, full)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
