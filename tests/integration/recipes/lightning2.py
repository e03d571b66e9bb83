"""Lightning 2.x: ``strategy="ddp"``, ``configure_optimizers`` returns ``oss_plus.OSS``.

Lightning calls ``consolidate_state_dict()`` on every rank before ``ModelCheckpoint`` saves,
then ``state_dict()`` on rank 0, and ``load_state_dict`` on every rank when resuming with
``ckpt_path``: nothing to add. Run: ``torchrun --nproc_per_node 2 lightning2.py train|resume OUT``.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from common import EPOCHS, LIGHTNING_TRAINER, LR, args, dataset, dump, full_state, tiny_model
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from oss_plus import OSS


# [recipe]
class Regression(L.LightningModule):
    def __init__(self, sharded: bool = True) -> None:
        super().__init__()
        self.model = tiny_model()
        self.sharded = sharded

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        if self.sharded:
            return OSS(self.parameters(), optim=torch.optim.Adam, lr=LR)
        return torch.optim.Adam(self.parameters(), lr=LR)  # the unsharded reference


def fit(module: Regression, epochs: int, out: str, ckpt_path: str | None = None) -> L.Trainer:
    trainer = L.Trainer(
        strategy="ddp",
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=out, filename="ckpt")],
        **LIGHTNING_TRAINER,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=4), ckpt_path=ckpt_path)
    return trainer


# [/recipe]


def main() -> None:
    phase, out = args()
    ckpt_dir = os.path.join(out, "ckpt")
    if phase == "train":
        reference = Regression(sharded=False)
        trainer = fit(reference, EPOCHS, os.path.join(out, "unused"))
        dump(f"{out}/reference.safetensors", reference.model, full_state(trainer.optimizers[0]))
        fit(Regression(), 1, ckpt_dir)
    else:
        module = Regression()
        trainer = fit(module, EPOCHS, ckpt_dir, ckpt_path=os.path.join(ckpt_dir, "ckpt.ckpt"))
        dump(f"{out}/resumed.safetensors", module.model, full_state(trainer.optimizers[0]))


if __name__ == "__main__":
    main()
