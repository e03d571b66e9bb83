"""Bit-exact parity with the unsharded optimizer, on 1-4 ranks and an offset subgroup."""

import pytest
import torch
from helpers import (
    WORLD_IDS,
    WORLDS,
    clone_model,
    flat_params,
    groups_of,
    make_model,
    train_in_lockstep,
)

from oss_plus import OSS

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


def parity_task(ctx, name, two_groups, rule, steps=4):
    optim, kwargs = OPTIMIZERS[name]
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(
        groups_of(model, two_groups), optim=optim, group=ctx.group, partition_rule=rule, **kwargs
    )
    ref = optim(groups_of(ref_model, two_groups), **kwargs)
    exact = train_in_lockstep(model, opt, ref_model, ref, steps)
    owned = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    return {"exact": exact, "params": flat_params(model), "owned": owned}


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parity_with_unsharded_optimizer(pool, world, name):
    results = pool.run(parity_task, name, False, "fairscale", **world)
    for rank, r in enumerate(results):
        assert all(r["exact"]), f"rank {rank} diverged from unsharded {name}: {r['exact']}"
        assert torch.equal(r["params"], results[0]["params"]), "replicas differ"
    total = results[0]["params"].numel()
    assert sum(r["owned"] for r in results) == total  # every param owned exactly once


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
@pytest.mark.parametrize("rule", ["fairscale", "torch"])
def test_parity_with_two_param_groups_and_different_lrs(pool, world, rule):
    for name in ("adam", "sgd_momentum"):
        results = pool.run(parity_task, name, True, rule, **world)
        for r in results:
            assert all(r["exact"])
            assert torch.equal(r["params"], results[0]["params"])
