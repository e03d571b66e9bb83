"""The Hugging Face ``Trainer`` with ``oss_plus.OSS`` passed in ``optimizers=``.

``Trainer`` prepares the optimizer with Accelerate, whose ``prepare`` calls ``state_dict()``
on every process (``collective_state_dict=True`` handles it), and saves the optimizer by
calling ``state_dict()`` on the saving rank only: a callback consolidates on every rank just
before each save, so that call returns the consolidated state without communicating.
The model (a tiny ``PreTrainedModel`` built from a config, nothing downloaded) is saved with
``save_pretrained`` (safetensors).
Run: ``torchrun --nproc_per_node 2 hf_trainer.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
from common import EPOCHS, LR, args, dataset, dump, full_state, tiny_model
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from oss_plus import OSS


class TinyConfig(PretrainedConfig):
    model_type = "oss_plus_tiny"


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = tiny_model()
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Keep tiny_model()'s seeded weights."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


# [recipe]
class ConsolidateBeforeSave(TrainerCallback):
    """Trainer saves the optimizer from one rank: consolidate on every rank just before."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save:
            inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
            inner.consolidate_state_dict()  # on every rank


def training_arguments(out: str) -> TrainingArguments:
    """The arguments; reading ``.device`` initializes torch.distributed (before OSS)."""
    arguments = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        num_train_epochs=EPOCHS,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=4,  # one epoch: 32 samples, 2 ranks, 4 per rank per step
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )
    assert arguments.device.type == "cpu"
    return arguments


def trainer_for(model: TinyModel, optimizer: torch.optim.Optimizer, out: str) -> Trainer:
    arguments = training_arguments(out)
    data = [{"x": x, "labels": y} for x, y in dataset()]
    return Trainer(
        model=model,
        args=arguments,
        train_dataset=data,
        optimizers=(optimizer, None),
        callbacks=[ConsolidateBeforeSave()],
    )


def sharded(model: TinyModel) -> OSS:
    return OSS(model.parameters(), optim=torch.optim.Adam, lr=LR, collective_state_dict=True)


# [/recipe]


def optimizer_for(model: TinyModel) -> torch.optim.Optimizer:
    """``sharded(model)``, or for the test's control run the plain optimizer, no oss_plus."""
    if os.environ.get("RECIPE_OPTIMIZER") == "plain":
        return torch.optim.Adam(model.parameters(), lr=LR)
    return sharded(model)


def trainer_with(model: TinyModel, optimizer: torch.optim.Optimizer, out: str) -> Trainer:
    """``trainer_for``; without the consolidating callback for a plain optimizer."""
    trainer = trainer_for(model, optimizer, out)
    if not isinstance(optimizer, OSS):
        trainer.remove_callback(ConsolidateBeforeSave)
    return trainer


class StopAfterFirstEpoch(TrainerCallback):
    """Ends the first run after its checkpoint at step 4 (a job that was interrupted)."""

    def on_save(self, args, state, control, **kwargs):
        control.should_training_stop = True


def main() -> None:
    phase, out = args()
    ckpt_dir = os.path.join(out, "ckpt")
    if phase == "train":
        model = TinyModel(TinyConfig())
        reference = torch.optim.Adam(model.parameters(), lr=LR)  # the unsharded reference
        trainer = trainer_for(model, reference, os.path.join(out, "reference"))
        trainer.args.save_strategy = "no"
        trainer.train()
        dump(f"{out}/reference.safetensors", model.net, reference.state_dict())
        model = TinyModel(TinyConfig())
        trainer = trainer_with(model, optimizer_for(model), ckpt_dir)
        trainer.add_callback(StopAfterFirstEpoch())
        trainer.train()
    else:
        training_arguments(ckpt_dir)  # torch.distributed first
        model = TinyModel(TinyConfig())
        optimizer = optimizer_for(model)
        trainer = trainer_with(model, optimizer, ckpt_dir)
        trainer.train(resume_from_checkpoint=os.path.join(ckpt_dir, "checkpoint-4"))
        dump(f"{out}/resumed.safetensors", model.net, full_state(optimizer))


if __name__ == "__main__":
    main()
