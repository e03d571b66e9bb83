"""Lightning 1.9: ``strategy="ddp_sharded"`` (fairscale's OSS and ShardedDataParallel) with
``oss_plus.compat.install()``, which makes ``fairscale.optim.OSS`` the oss_plus adapter.

Call ``install()`` before ``pytorch_lightning`` is imported. AdamW, as in the run that found
issue 36 (the sharded run diverged since 529d4c7: fairscale's ``ShardedDataParallel``
re-plans the optimizer in its first forward, inside Lightning's step closure). Lightning 1.9
rebuilds the optimizer from ``opt.defaults``, which fairscale's own ``OSS`` cannot do for
AdamW on torch 2.13 (``decoupled_weight_decay``); the adapter can. The test also fails when a
rank aborts at exit (torchrun's status). The scheduler is built on the user's AdamW: it drives
the sharded optimizer because the adapter keeps the param-group dicts Lightning passes (before
issue 36 it copied them and the lr never changed). Run:
``torchrun --nproc_per_node 2 lightning_1_9.py train|resume OUT`` (the test: ``tox -e
integration-lightning19``, about 40 s).
"""

from __future__ import annotations

import os

# [recipe]
import oss_plus.compat.fairscale

oss_plus.compat.fairscale.install()  # before pytorch_lightning imports fairscale.optim.OSS

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from common import EPOCHS, LIGHTNING_TRAINER, LR, args, dataset, dump, full_state, tiny_model  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)  # ddp_sharded wraps it in OSS
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def fit(module: Regression, epochs: int, out: str, strategy: str, ckpt_path: str | None = None):
    trainer = pl.Trainer(
        strategy=strategy,
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
        reference = Regression()
        trainer = fit(reference, EPOCHS, os.path.join(out, "unused"), "ddp")
        dump(f"{out}/reference.safetensors", reference.model, full_state(trainer.optimizers[0]))
        fit(Regression(), 1, ckpt_dir, "ddp_sharded")
    else:
        module = Regression()
        path = os.path.join(ckpt_dir, "ckpt.ckpt")
        trainer = fit(module, EPOCHS, ckpt_dir, "ddp_sharded", ckpt_path=path)
        dump(f"{out}/resumed.safetensors", module.model, full_state(trainer.optimizers[0]))


if __name__ == "__main__":
    main()
