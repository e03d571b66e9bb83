"""mmengine 0.10's ``Runner`` with a ZeRO optimizer and its default ``CheckpointHook`` only,
no ``OssConsolidateHook`` (issue 56).

``RECIPE_OPTIMIZER`` picks the route:

* ``mmengine`` (default): mmengine's own ``ZeroRedundancyOptimizer`` (registered in its
  ``OPTIMIZERS``), built on oss_plus's class by ``oss_plus.compat.torch.install()`` at the
  top of this file, before mmengine binds torch's class. Its ``state_dict()`` override calls
  ``consolidate_state_dict()`` and then ``state_dict()`` on whichever rank calls it
  (``mmengine/optim/optimizer/zero_optimizer.py``), and mmengine calls it on rank 0 only
  (``Runner.save_checkpoint`` is ``master_only``), after the epoch's last step;
* ``oss_plus``: ``OssZeroRedundancyOptimizer``, registered by ``oss_plus.integrations.mmengine``
  (``custom_imports``); mmengine calls its ``state_dict()`` on rank 0 only.

The resume calls ``load_state_dict()`` on every rank (``Runner.resume``).
``mmengine_recipe.py`` is the explicit form (with the hook); this file reuses its model,
dataset and ``runner``.
Run: ``torchrun --nproc_per_node 2 mmengine_no_recipe.py train|resume OUT``.
"""

from __future__ import annotations

import os

import oss_plus.compat.torch as zero_compat

ROUTE = os.environ.get("RECIPE_OPTIMIZER", "mmengine")
if ROUTE == "mmengine":
    zero_compat.install()  # before mmengine.optim binds torch's ZeroRedundancyOptimizer

import torch.distributed as dist  # noqa: E402
from common import EPOCHS, LR, args, dump, rank  # noqa: E402
from mmengine_recipe import ITERS_PER_EPOCH, MMENGINE_LOAD, CountIters, runner  # noqa: E402

#: What both routes' config files share with ``mmengine_recipe.CONFIG`` (no custom hook).
COMMON = f"""
default_hooks = dict(checkpoint=dict(type="CheckpointHook", interval=1))
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

CONFIGS = {
    "mmengine": f"""
optim_wrapper = dict(
    optimizer=dict(type="ZeroRedundancyOptimizer", optimizer_type="Adam", lr={LR})
)
""",
    "oss_plus": f"""
custom_imports = dict(imports=["oss_plus.integrations.mmengine"], allow_failed_imports=False)
optim_wrapper = dict(
    optimizer=dict(type="OssZeroRedundancyOptimizer", optimizer_type="Adam", lr={LR})
)
""",
}


def full_state(optimizer: zero_compat.ZeroRedundancyOptimizer):
    """The full state on rank 0 for the dump, past mmengine's ``state_dict()`` override
    (which consolidates on the calling rank alone)."""
    optimizer.consolidate_state_dict(0)
    return zero_compat.ZeroRedundancyOptimizer.state_dict(optimizer) if rank() == 0 else None


def main() -> None:
    phase, out = args()
    dist.init_process_group("gloo")  # mmengine's own init calls torch.cuda.set_device
    config = CONFIGS[ROUTE] + COMMON
    if phase == "train":
        reference = runner(out, "reference", plain=True, config=config)
        reference.train()
        state = reference.optim_wrapper.optimizer.state_dict()
        dump(f"{out}/reference.safetensors", reference.model.module.net, state)
        runner(out, "ckpt", config=config).train()
    else:
        first = os.path.join(out, "ckpt", "epoch_1.pth")
        os.environ.update(MMENGINE_LOAD)
        resumed = runner(out, "resumed", config=config, resume=True, load_from=first)
        resumed.register_hook(dict(type="CountIters"))
        resumed.train()
        if CountIters.count != ITERS_PER_EPOCH * (EPOCHS - 1):
            raise SystemExit(f"resumed at the wrong point: trained {CountIters.count} iterations")
        optimizer = resumed.optim_wrapper.optimizer
        dump(f"{out}/resumed.safetensors", resumed.model.module.net, full_state(optimizer))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
