"""ShardedDataParallel: the pure reduce plan, bad input (raised on every rank), API surface."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import catch
from sdp_utils import Net, batch, pair

from oss_plus import OSS, ShardedDataParallel
from oss_plus.data_parallel import _validate
from oss_plus.data_parallel.plan import GradSpec, plan_buckets
from oss_plus.data_parallel.reducer import NOTHING_TO_REDUCE, SECOND_BACKWARD


# ----------------------------------------------------------------- the plan (pure)
def _specs(sizes, owners, keys=None):
    keys = keys or ["f32"] * len(sizes)
    return [GradSpec(n, o, k) for n, o, k in zip(sizes, owners, keys)]


@pytest.mark.parametrize("cap", [0, 1, 5, 10, 100])
def test_plan_covers_each_param_once_within_the_cap(cap):
    sizes, owners = [3, 4, 2, 8, 1, 5, 6], [0, 1, 0, 1, 0, 2, 2]
    keys = ["f32", "f32", "bf16", "f32", "f32", "f32", "f32"]
    plan = plan_buckets(_specs(sizes, owners, keys), cap)
    members = [i for b in plan.buckets for i in b.members]
    assert sorted(members) == list(range(len(sizes)))
    for b in plan.buckets:
        assert {owners[i] for i in b.members} == {b.owner}
        assert len({keys[i] for i in b.members}) == 1
        assert b.numel == sum(sizes[i] for i in b.members)
        assert len(b.members) == 1 or b.numel <= cap
        assert list(b.offsets) == [
            sum(sizes[i] for i in b.members[:k]) for k in range(len(b.members))
        ]
    for i, (b, slot) in plan.position.items():
        assert plan.buckets[b].members[slot] == i
    if cap == 0:
        assert all(len(b.members) == 1 for b in plan.buckets)


def test_plan_orders_buckets_by_when_backward_completes_them():
    # backward produces grads in reverse order: 5, 4, ..., 0
    plan = plan_buckets(_specs([1] * 6, [0, 1, 0, 1, 0, 1]), 100)
    last = [min(b.members) for b in plan.buckets]  # the member backward reaches last
    assert last == sorted(last, reverse=True)
    assert [b.members for b in plan.buckets] == [(5, 3, 1), (4, 2, 0)]


# ----------------------------------------------------------------- bad input on every rank
def bad_input_task(ctx, case):
    torch.manual_seed(0)
    model = Net()
    if case == "not_oss":
        return catch(
            ShardedDataParallel, model, torch.optim.SGD(model.parameters(), lr=0.1), ctx.group
        )
    if case == "list_with_non_oss":
        opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
        return catch(ShardedDataParallel, model, [opt, object()], ctx.group)
    if case == "other_group":
        mine = (0, 1) if ctx.rank < 2 else (2, 3)
        opt = OSS(model.parameters(), group=ctx.groups[mine], lr=0.1)
        return catch(ShardedDataParallel, model, opt, ctx.group)
    if case == "missing_params":
        opt = OSS(list(model.parameters())[:-1], group=ctx.group, lr=0.1)
        return catch(ShardedDataParallel, model, opt, ctx.group)
    if case == "missing_on_one_rank":  # only rank 1 forgot a param: still every rank raises
        params = list(model.parameters())
        opt = OSS(params, group=ctx.group, lr=0.1)
        if ctx.rank == 1:
            model.extra = torch.nn.Linear(2, 2)
        return catch(ShardedDataParallel, model, opt, ctx.group)
    if case == "shared_param":
        params = list(model.parameters())
        first = OSS(params, group=ctx.group, lr=0.1)
        second = OSS(params[:1], group=ctx.group, lr=0.1)
        return catch(ShardedDataParallel, model, [first, second], ctx.group)
    if case == "bad_reduce_dtype":
        opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
        return catch(ShardedDataParallel, model, opt, ctx.group, reduce_dtype=torch.int8)
    if case == "moved":
        opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
        sdp = ShardedDataParallel(model, opt, ctx.group)
        sdp.module.to("meta")
        return catch(sdp, batch(0, ctx.rank))
    raise AssertionError(case)


CASES = {
    "not_oss": ("TypeError", "needs sharded_optimizer to be an oss_plus.OSS"),
    "list_with_non_oss": ("TypeError", "list of [OSS, object]"),
    "other_group": ("ValueError", "pass process_group=<the optimizer's group>"),
    "missing_params": ("ValueError", "head.bias"),
    "shared_param": ("ValueError", "is in optimizers 0 and 1"),
    "bad_reduce_dtype": ("ValueError", "reduce_dtype must be"),
    "moved": ("ValueError", "moved from cpu to meta"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(pool, case):
    kind, text = CASES[case]
    for result in pool.run(bad_input_task, case, world_size=4):
        assert result[0] == kind and text in result[1], result


def test_error_detected_on_one_rank_reaches_every_rank(pool):
    results = pool.run(bad_input_task, "missing_on_one_rank", world_size=2)
    assert results[1][0] == "ValueError" and "extra.weight" in results[1][1]
    assert results[0][0] == "ValueError" and "rank(s) [1]" in results[0][1]
    assert results[1][1] in results[0][1]  # rank 0 names rank 1's own error


def test_messages_name_the_fix():
    assert "opt.group" in _validate.OTHER_GROUP
    assert "requires_grad=False" in _validate.MISSING_PARAMS
    assert "no_sync()" in SECOND_BACKWARD and "no_sync()" in NOTHING_TO_REDUCE


# ----------------------------------------------------------------- API surface
def api_task(ctx):
    sdp, opt, ddp, ref_opt = pair(ctx, 64)
    out = {"fallthrough": sdp.head is sdp.module.head}
    # manual reduce after a backward inside no_sync equals DDP's synced gradients
    out["nothing"] = catch(sdp.reduce)
    with sdp.no_sync():
        sdp(batch(0, ctx.rank)).pow(2).mean().backward()
    sdp.reduce()
    ddp(batch(0, ctx.rank)).pow(2).mean().backward()
    out["manual"] = all(
        torch.equal(p.grad, q.grad) if p.grad is not None else opt.param_to_rank[p] != ctx.rank
        for p, q in zip(sdp.module.parameters(), ddp.module.parameters())
    )
    # a second backward through the same forward is refused on every rank
    loss = sdp(batch(1, ctx.rank)).pow(2).mean()
    loss.backward(retain_graph=True)
    out["second"] = catch(loss.backward)
    sdp.zero_grad()
    out["zeroed"] = all(p.grad is None or not p.grad.any() for p in sdp.module.parameters())
    sdp.zero_grad(set_to_none=True)
    out["none"] = all(p.grad is None for p in sdp.module.parameters())
    return out


def test_reduce_zero_grad_and_attribute_fallthrough(pool):
    for out in pool.run(api_task, world_size=2):
        assert out["fallthrough"] and out["manual"] and out["zeroed"] and out["none"]
        assert out["nothing"] == ("RuntimeError", NOTHING_TO_REDUCE)
        assert out["second"][0] == "RuntimeError" and SECOND_BACKWARD in out["second"][1]


def dtype_task(ctx):
    """module.double() after wrapping: the plan follows the new dtype (reduced in float64)."""
    torch.manual_seed(0)
    model = Net()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    sdp = ShardedDataParallel(model, opt, ctx.group, reduce_buffer_size=64)
    sdp.module.double()
    local = copy.deepcopy(sdp.module)
    x = batch(0, ctx.rank).double()
    sdp(x).pow(2).mean().backward()
    local(x).pow(2).mean().backward()
    ok = True
    for p, q in zip(sdp.module.parameters(), local.parameters()):
        expected = q.grad / ctx.world_size
        dist.all_reduce(expected, group=ctx.group)
        if opt.param_to_rank[p] == ctx.rank:
            ok &= p.grad.dtype == torch.float64 and torch.equal(p.grad, expected)
        else:
            ok &= p.grad is None
    opt.step()
    return ok


def test_dtype_change_after_wrapping_is_followed(pool):
    assert all(pool.run(dtype_task, world_size=2))


def refresh_task(ctx):
    """auto_refresh_trainable=False: the user refreshes; gradients follow the new owners."""
    sdp, opt, _, _ = pair(ctx, 0, auto_refresh_trainable=False)
    before = dict(opt.param_to_rank)
    sdp.module.fc1.weight.requires_grad_(False)
    sdp.refresh_trainable()
    after = opt.param_to_rank
    sdp(batch(0, ctx.rank)).pow(2).mean().backward()
    owned_grads = all(
        (p.grad is not None) == (p.requires_grad and after[p] == ctx.rank)
        for p in sdp.module.parameters()
    )
    return before != after, owned_grads


def test_refresh_trainable_reroutes_to_the_new_owners(pool):
    for moved, owned in pool.run(refresh_task, world_size=2):
        assert moved and owned
