"""The two classes every fairscale differential scenario runs through."""

from __future__ import annotations

import pytest

pytest.importorskip("fairscale")

from fairscale.optim.oss import OSS as FairscaleOSS  # noqa: E402
from helpers import SGD_AND_ADAM  # noqa: E402

from oss_plus.compat.fairscale import OSS  # noqa: E402

CLASSES = {"fairscale": FairscaleOSS, "ours": OSS}


def build(kind, params, ctx, optim_name="sgd", **extra):
    optim, kwargs = SGD_AND_ADAM[optim_name]
    return CLASSES[kind](params, optim=optim, group=ctx.group, **{**kwargs, **extra})
