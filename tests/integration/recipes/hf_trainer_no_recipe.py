"""The Hugging Face ``Trainer`` with ``oss_plus.OSS`` written as the plain optimizer (issue 56).

No ``collective_state_dict=True`` and no consolidating callback. ``Trainer.train`` prepares
the optimizer with Accelerate (``state_dict()`` and ``load_state_dict()`` on every process,
before the first step), saves it with ``torch.save(self.optimizer.state_dict(), ...)`` under
``args.should_save``, i.e. on rank 0 only, after the step that reaches ``save_steps``
(``transformers/trainer.py``, ``_save_optimizer_and_scheduler``), and resumes with
``load_state_dict()`` on every process. ``hf_trainer.py`` is the explicit form, and holds the
model and arguments this recipe shares.
Run: ``torchrun --nproc_per_node 2 hf_trainer_no_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
from common import LR, args, dataset, dump, full_state
from hf_trainer import StopAfterFirstEpoch, TinyConfig, TinyModel, training_arguments
from transformers import Trainer

from oss_plus import OSS


def trainer_for(model: TinyModel, optimizer: torch.optim.Optimizer, out: str) -> Trainer:
    data = [{"x": x, "labels": y} for x, y in dataset()]
    arguments = training_arguments(out)
    return Trainer(model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None))


def optimizer_for(model: TinyModel) -> torch.optim.Optimizer:
    """``OSS`` as the plain optimizer is written, or for the test's control run the plain
    optimizer itself."""
    if os.environ.get("RECIPE_OPTIMIZER") == "plain":
        return torch.optim.Adam(model.parameters(), lr=LR)
    return OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)


def main() -> None:
    phase, out = args()
    ckpt_dir = os.path.join(out, "ckpt")
    training_arguments(ckpt_dir)  # torch.distributed first, before OSS
    if phase == "train":
        model = TinyModel(TinyConfig())
        reference = torch.optim.Adam(model.parameters(), lr=LR)  # the unsharded reference
        trainer = trainer_for(model, reference, os.path.join(out, "reference"))
        trainer.args.save_strategy = "no"
        trainer.train()
        dump(f"{out}/reference.safetensors", model.net, reference.state_dict())
        model = TinyModel(TinyConfig())
        trainer = trainer_for(model, optimizer_for(model), ckpt_dir)
        trainer.add_callback(StopAfterFirstEpoch())
        trainer.train()
    else:
        model = TinyModel(TinyConfig())
        optimizer = optimizer_for(model)
        trainer = trainer_for(model, optimizer, ckpt_dir)
        trainer.train(resume_from_checkpoint=os.path.join(ckpt_dir, "checkpoint-4"))
        dump(f"{out}/resumed.safetensors", model.net, full_state(optimizer))


if __name__ == "__main__":
    main()
