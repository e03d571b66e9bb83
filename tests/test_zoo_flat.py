"""The flat rule and the ecosystem's optimizers (issue 49, item 4): the ones whose update is
elementwise are declared (``step.pieces.ELEMENTWISE_NAMES``) and must be bit-identical to the
unsharded optimizer with params cut into pieces stepped on several ranks; every other one of
the zoo keeps being refused on every rank. The schedule-free ones, whose modes move the
pieces too, are checked in tests/test_modes.py."""

from __future__ import annotations

import pytest
import torch
import zoo
from helpers import catch, clone_model, flat_params, groups_of, make_model, train_in_lockstep

from oss_plus import OSS
from oss_plus.step.pieces import is_elementwise

STEPS = 4
#: zoo names whose flat runs are checked here (schedule-free: test_modes.py)
DECLARED = [n for n, z in zoo.ZOO.items() if z.elementwise and "ScheduleFree" not in n]
REFUSED = [n for n, z in zoo.ZOO.items() if not z.elementwise]
HERE = [n for n in DECLARED if zoo.available(zoo.ZOO[n].need)]


def flat_task(ctx, names):
    out = {}
    for name in names:
        cls, kwargs = zoo.ZOO[name].make()
        model = make_model(depth=4)
        ref_model = clone_model(model)
        opt = OSS(groups_of(model, False), optim=cls, group=ctx.group, partition_rule="flat",
                  **kwargs)  # fmt: skip
        ref = cls(groups_of(ref_model, False), **kwargs)
        exact = train_in_lockstep(model, opt, ref_model, ref, STEPS)
        out[name] = {"exact": exact, "params": flat_params(model), "split": len(opt.plan.split)}
    return out


@pytest.mark.skipif(not HERE, reason="none of the zoo's packages is installed")
@pytest.mark.parametrize(
    "world",
    [{"world_size": 2}, {"world_size": 3}, {"ranks": (2, 3)}],
    ids=["ws2", "ws3", "offset23"],
)
def test_declared_optimizers_are_exact_under_the_flat_rule(pool, world):
    results = pool.run(flat_task, HERE, timeout=180, **world)
    for name in HERE:
        assert results[0][name]["split"] > 0, "the model must be cut inside params"
        for rank, r in enumerate(results):
            assert all(r[name]["exact"]), f"{name}: rank {rank} diverged: {r[name]['exact']}"
            assert torch.equal(r[name]["params"], results[0][name]["params"]), "replicas differ"


@pytest.mark.parametrize("name", zoo.params(DECLARED))
def test_the_declared_classes_are_the_zoo_s_elementwise_ones(name):
    assert is_elementwise(zoo.ZOO[name].make()[0])


def refused_task(ctx, names):
    out = {}
    for name in names:
        cls, kwargs = zoo.ZOO[name].make()
        model = make_model(depth=2)
        out[name] = catch(OSS, model.parameters(), optim=cls, group=ctx.group,
                          partition_rule="flat", **kwargs)  # fmt: skip
    return out


def test_the_others_are_refused_on_every_rank(pool):
    names = [n for n in REFUSED if zoo.available(zoo.ZOO[n].need)]
    if not names:
        pytest.skip("none of the zoo's packages is installed")
    for per_rank in pool.run(refused_task, names, world_size=2, timeout=120):
        for name in names:
            kind, message = per_rank[name]
            assert kind == "ValueError" and "partition_rule='flat'" in message, (name, message)
