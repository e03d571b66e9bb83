"""The opt-in collective ``state_dict()`` and ``isinstance`` against torch's ZeRO (issue 15).

Frameworks that call ``state_dict()`` on every rank without consolidating (Accelerate,
Ignite with a non-torch class) work under ``collective_state_dict=True``; a call on a subset
of the ranks raises on the ranks that called instead of hanging.
"""

import copy
from datetime import timedelta

import pytest
import torch
from helpers import catch, make_model, train

from oss_plus import OSS
from oss_plus.compat import fairscale
from oss_plus.compat import torch as torch_compat
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime.positions import NOT_REPORTED as NO_CALL
from oss_plus.state.api import NOT_CONSOLIDATED, STATE_DICT_HINT

KINDS = ["oss", "fairscale", "torch"]
#: The same, for the tests that compare with the unsharded Adam bit for bit: the fairscale
#: adapter keeps fairscale's unpadded buckets, whose params MKL's matrix-vector product rounds
#: alike only with reproducible BLAS (conftest.py, docs/portability.md).
EXACT_KINDS = ["oss", pytest.param("fairscale", marks=pytest.mark.reproducible_blas), "torch"]


def build(kind, model, ctx, **extra):
    params = model.parameters()
    if kind == "oss":
        return OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01, **extra)
    if kind == "fairscale":
        return fairscale.OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01, **extra)
    return torch_compat.ZeroRedundancyOptimizer(
        params, torch.optim.Adam, process_group=ctx.group, lr=0.01, **extra
    )


def reference_state(steps):
    """The unsharded Adam's state dict after ``steps`` steps (the independent reference)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, steps)
    return opt.state_dict()


def assert_same_state(got, want):
    assert sorted(got["state"]) == sorted(want["state"])
    for index, state in want["state"].items():
        assert sorted(got["state"][index]) == sorted(state)
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got["state"][index][key]), value), (index, key)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]


# ------------------------------------------------------------------ every rank calls
def every_rank_task(ctx, kind):
    model = make_model()
    opt = build(kind, model, ctx, collective_state_dict=True)
    # Accelerate's prepare(): state_dict() then load_state_dict() on every process
    opt.load_state_dict(opt.state_dict())
    train(model, opt, 3)
    first = copy.deepcopy(opt.state_dict())  # save_state: every process, nothing consolidated
    again = opt.state_dict()  # consolidated already: no communication, same result
    return first, again


@pytest.mark.parametrize("kind", EXACT_KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_on_every_rank_consolidates_itself(pool, kind, world):
    want = reference_state(3)
    for first, again in pool.run(every_rank_task, kind, world_size=world):
        assert_same_state(first, want)
        assert_same_state(again, want)


def off_by_default_task(ctx, kind):
    model = make_model()
    opt = build(kind, model, ctx)
    train(model, opt, 1)
    got = catch(lambda: copy.deepcopy(opt.state_dict()))
    torch.distributed.barrier(group=ctx.group)  # each rank's optimizer lives until all read
    return got


@pytest.mark.parametrize("kind", ["oss", "torch"])
def test_without_the_opt_in_state_dict_reads_the_shards_itself(pool, kind):
    """No collective then: each rank reads the others' shards (issue 56, test_state_read.py)."""
    want = reference_state(1)
    for name, got in pool.run(off_by_default_task, kind, world_size=2):
        assert name == "ok", got
        assert_same_state(got, want)


def test_without_the_opt_in_the_fairscale_adapter_keeps_fairscales_contract(pool):
    """fairscale raises unless consolidated first (its own suite pins it): so does the adapter."""
    for rank, got in enumerate(pool.run(off_by_default_task, "fairscale", world_size=2)):
        assert got == ("RuntimeError", NOT_CONSOLIDATED.format(rank=rank))


# ------------------------------------------------------------------ one rank calls
def one_rank_task(ctx, kind, caller):
    model = make_model()  # built and trained under the default arrival timeout (a 1 s bound
    opt = build(kind, model, ctx, collective_state_dict=True)  # would fail a slow start)
    train(model, opt, 2)
    default, _arrival.ARRIVAL_TIMEOUT = _arrival.ARRIVAL_TIMEOUT, timedelta(seconds=1)
    try:
        return one_rank_scenario(ctx, model, opt, caller)
    finally:
        _arrival.ARRIVAL_TIMEOUT = default


def one_rank_scenario(ctx, model, opt, caller):
    alone = catch(opt.state_dict) if ctx.rank == caller else None
    torch.distributed.barrier(group=ctx.group)  # the other rank does something else meanwhile
    together = copy.deepcopy(opt.state_dict())  # recovers once every rank calls (live tensors)
    train(model, opt, 1, start=2)
    opt.consolidate_state_dict()  # Lightning / Trainer recipe: then rank 0 only
    saved = opt.state_dict() if ctx.rank == 0 else None
    return alone, together, saved


@pytest.mark.parametrize("kind", EXACT_KINDS)
@pytest.mark.parametrize("caller", [0, 1])
def test_a_call_on_one_rank_raises_there_and_never_hangs(pool, kind, caller):
    results = pool.run(one_rank_task, kind, caller, world_size=2, timeout=60)
    name, message = results[caller][0]
    assert name == "RuntimeError"
    assert message == _arrival.NOT_ALL_ARRIVED.format(
        what="state_dict()",
        arrived=1,
        world=2,
        seconds=1.0,
        rank=f"global rank {caller}",
        hint=STATE_DICT_HINT,
    ) + _arrival.WHERE.format(
        where=f"global rank 0 {'(this rank) is here' if caller == 0 else NO_CALL}; "
        f"global rank 1 {'(this rank) is here' if caller == 1 else NO_CALL}"
    )
    after_two, after_three = reference_state(2), reference_state(3)
    for _, together, _ in results:
        assert_same_state(together, after_two)
    assert_same_state(results[0][2], after_three)


# ------------------------------------------------------------------ isinstance
def test_the_torch_adapter_is_a_virtual_subclass_of_torchs_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    assert issubclass(torch_compat.ZeroRedundancyOptimizer, TorchZero)
    assert TorchZero not in torch_compat.ZeroRedundancyOptimizer.__mro__
    # their consolidate_state_dict() takes recipient_rank, not torch's `to`: not registered
    assert not issubclass(OSS, TorchZero)
    assert not issubclass(fairscale.OSS, TorchZero)


def ignite_like_task(ctx):
    """What Ignite's Checkpoint does for torch's class, run on the adapter."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    model = make_model()
    opt = build("torch", model, ctx)
    train(model, opt, 3)
    assert isinstance(opt, TorchZero)
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if ctx.rank == 0 else None


def test_code_that_special_cases_torchs_class_consolidates_the_adapter(pool):
    assert_same_state(pool.run(ignite_like_task, world_size=2)[0], reference_state(3))
