"""The two classes every torch differential scenario runs through."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from oss_plus.compat.torch import ZeroRedundancyOptimizer

CLASSES = {"torch": TorchZero, "ours": ZeroRedundancyOptimizer}
MODES = [False, True]
MODE_IDS = ["per_param", "bucket_view"]


def build(kind, params, ctx, bucket_view, optim=torch.optim.Adam, **kwargs):
    kwargs = kwargs or {"lr": 0.01}
    return CLASSES[kind](
        params, optim, process_group=ctx.group, parameters_as_bucket_view=bucket_view, **kwargs
    )
