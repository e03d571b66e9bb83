"""Lightning 2.x with loss scaling and gradient clipping: ``strategy="ddp"``, a
``GradScaler`` and ``gradient_clip_val``, ``configure_optimizers`` returns ``oss_plus.OSS``.

Lightning clips only the gradients of an optimizer that does not declare torch's
``_step_supports_amp_scaling`` (it raises for torch's fused optimizers); under ZeRO-1 ``OSS``
does not declare it, and torch's classic scaler path steps it. The sharded run must end
equal to the unsharded one. Run: ``torchrun --nproc_per_node 2 lightning2_amp.py train OUT``.
"""

from __future__ import annotations

import lightning as L
import torch
from common import EPOCHS, LIGHTNING_TRAINER, LR, args, dataset, dump, full_state, tiny_model
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from oss_plus import OSS


class Regression(L.LightningModule):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.model = tiny_model()
        self.sharded = sharded

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self):
        if self.sharded:
            return OSS(self.parameters(), optim=torch.optim.Adam, lr=LR)
        return torch.optim.Adam(self.parameters(), lr=LR)


def fit(module: Regression) -> L.Trainer:
    scaler = torch.amp.GradScaler("cpu")  # on GPUs Lightning makes this one itself
    trainer = L.Trainer(
        strategy="ddp",
        max_epochs=EPOCHS,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=0.05,
        enable_checkpointing=False,
        **LIGHTNING_TRAINER,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=4))
    return trainer


def main() -> None:
    _, out = args()
    reference = Regression(sharded=False)
    trainer = fit(reference)
    dump(f"{out}/reference.safetensors", reference.model, full_state(trainer.optimizers[0]))
    sharded = Regression(sharded=True)
    trainer = fit(sharded)
    dump(f"{out}/resumed.safetensors", sharded.model, full_state(trainer.optimizers[0]))


if __name__ == "__main__":
    main()
