"""The Hugging Face ``Trainer`` with ``oss_plus.OSS`` over a schedule-free optimizer.

``Trainer`` calls ``optimizer.train()`` at every training step and ``optimizer.eval()``
before evaluating, when the optimizer has them (Accelerate's wrapper forwards both): with
``OSS(..., optim=schedulefree.AdamWScheduleFree)`` they move every replica's params, the
first ``train()`` before the first step, every later one free. The recipe trains, evaluates
(the params move to the averaged point) and saves the model with ``save_model``: the
unsharded reference (the plain optimizer, the same flow) first, then the sharded run; the
test compares the two saved models.
Run: ``torchrun --nproc_per_node 2 hf_trainer_schedulefree.py train OUT``.
"""

from __future__ import annotations

import os

import schedulefree
import torch
from common import LR, args, dataset, rank
from hf_trainer import TinyConfig, TinyModel, training_arguments
from transformers import Trainer

from oss_plus import OSS


# [recipe]
def sharded(model: TinyModel) -> OSS:
    return OSS(
        model.parameters(),
        optim=schedulefree.AdamWScheduleFree,
        lr=LR,
        warmup_steps=2,
        collective_state_dict=True,  # Accelerate's prepare calls state_dict() on every rank
    )


def train_evaluate_save(model: TinyModel, optimizer: torch.optim.Optimizer, out: str) -> None:
    arguments = training_arguments(out)
    arguments.save_strategy = "no"
    data = [{"x": x, "labels": y} for x, y in dataset()]
    trainer = Trainer(model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None))
    trainer.train()  # optimizer.train() at every step
    if rank() == 0:  # the training point, for the test to see that eval() moved the params
        state = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(out, "y.pt"))
    trainer.evaluate(eval_dataset=data)  # optimizer.eval(): the averaged point
    trainer.save_model(out)  # model.safetensors, from rank 0


# [/recipe]


def main() -> None:
    phase, out = args()
    assert phase == "train"
    model = TinyModel(TinyConfig())
    reference = schedulefree.AdamWScheduleFree(model.parameters(), lr=LR, warmup_steps=2)
    train_evaluate_save(model, reference, os.path.join(out, "reference"))
    model = TinyModel(TinyConfig())
    train_evaluate_save(model, sharded(model), os.path.join(out, "sharded"))


if __name__ == "__main__":
    main()
