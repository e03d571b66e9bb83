"""mmengine 0.10: the ``Runner`` built from a config file that names oss_plus.

The config file imports ``oss_plus.integrations.mmengine`` (``custom_imports``), which
registers ``OssZeroRedundancyOptimizer`` (the local optimizer named by a string, as
mmengine's own ``ZeroRedundancyOptimizer`` takes it) and ``OssConsolidateHook``, which
consolidates on every rank before ``CheckpointHook`` saves from rank 0.

The sharded run trains both epochs and saves after each; fresh processes resume from the
first epoch's checkpoint in a fresh ``Runner`` (``resume=True``, ``load_from``), train the
last epoch and must end equal to an unsharded run (``torch.optim.Adam``, the same config
otherwise).

Run: ``torchrun --nproc_per_node 2 mmengine_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import EPOCHS, LR, args, dataset, dump, tiny_model
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, HOOKS, MODELS
from mmengine.runner import Runner

#: Iterations per epoch on each rank: 32 samples, 2 ranks, batches of 4.
ITERS_PER_EPOCH = 4


@MODELS.register_module()
class Regressor(BaseModel):
    """The shared tiny model as an mmengine model: ``mode="loss"`` returns the losses."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, inputs, targets=None, mode="tensor"):
        out = self.net(inputs)
        if mode == "loss":
            return {"loss": torch.nn.functional.mse_loss(out, targets)}
        return out


@DATASETS.register_module()
class RecipeData(torch.utils.data.Dataset):
    """The shared regression data as an mmengine dataset."""

    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


@HOOKS.register_module()
class CountIters(Hook):
    """Counts the iterations this process trains (a resume must train the last epoch only)."""

    count = 0

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        CountIters.count += 1


# [recipe]
CONFIG = f"""
custom_imports = dict(imports=["oss_plus.integrations.mmengine"], allow_failed_imports=False)
optim_wrapper = dict(
    optimizer=dict(type="OssZeroRedundancyOptimizer", optimizer_type="Adam", lr={LR})
)
default_hooks = dict(checkpoint=dict(type="CheckpointHook", interval=1))
custom_hooks = [dict(type="OssConsolidateHook")]  # consolidates before CheckpointHook saves

model = dict(type="Regressor")
train_dataloader = dict(
    batch_size=4,
    dataset=dict(type="RecipeData"),
    sampler=dict(type="DefaultSampler", shuffle=False),
    collate_fn=dict(type="default_collate"),
)
train_cfg = dict(by_epoch=True, max_epochs={EPOCHS})
launcher = "pytorch"
model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None)  # CPU
"""
# [/recipe]


def runner(out: str, name: str, plain: bool = False, config: str = CONFIG, **resume) -> Runner:
    """A ``Runner`` from ``config`` (this recipe's by default) written as a file."""
    path = os.path.join(out, "config.py")
    if dist.get_rank() == 0:
        with open(path, "w") as file:
            file.write(config)
    dist.barrier()
    cfg = Config.fromfile(path)
    cfg.work_dir = os.path.join(out, name)
    if plain:  # the unsharded reference
        cfg.optim_wrapper = dict(optimizer=dict(type="Adam", lr=LR))
    cfg.merge_from_dict(resume)
    return Runner.from_cfg(cfg)


#: mmengine 0.10.7 pickles numpy arrays and its message hub's objects into its checkpoints
#: and reads them with torch.load's default, weights_only=True since torch 2.6: its resume
#: fails whatever the optimizer (a plain Adam too) unless this is set (mmengine's own
#: checkpoints, which it saves itself; docs/integrations.md). oss_plus's part of them is
#: plain tensors and numbers.
MMENGINE_LOAD = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def main() -> None:
    phase, out = args()
    dist.init_process_group("gloo")  # mmengine's own init calls torch.cuda.set_device
    if phase == "train":
        reference = runner(out, "reference", plain=True)
        reference.train()
        state = reference.optim_wrapper.optimizer.state_dict()
        dump(f"{out}/reference.safetensors", reference.model.module.net, state)
        runner(out, "ckpt").train()
    else:
        first = os.path.join(out, "ckpt", "epoch_1.pth")
        os.environ.update(MMENGINE_LOAD)
        resumed = runner(out, "resumed", resume=True, load_from=first)
        resumed.register_hook(dict(type="CountIters"))
        resumed.train()
        if CountIters.count != ITERS_PER_EPOCH * (EPOCHS - 1):
            raise SystemExit(f"resumed at the wrong point: trained {CountIters.count} iterations")
        optimizer = resumed.optim_wrapper.optimizer
        optimizer.consolidate_state_dict(0)
        full = optimizer.state_dict() if dist.get_rank() == 0 else None
        dump(f"{out}/resumed.safetensors", resumed.model.module.net, full)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
