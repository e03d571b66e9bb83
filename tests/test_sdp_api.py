"""ShardedDataParallel: the pure reduce plan, bad input (raised on every rank), API surface."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import catch
from sdp_utils import Net, batch, pair

from oss_plus import OSS, ShardedDataParallel
from oss_plus.data_parallel import _validate
from oss_plus.data_parallel.plan import GradSpec, launch_groups, plan_buckets
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


@pytest.mark.parametrize("cap", [0, 5, 100])
def test_scatter_groups_hold_one_bucket_per_owner_in_plan_order(cap):
    sizes, owners = [3, 4, 2, 8, 1, 5, 6, 2], [0, 1, 0, 1, 0, 2, 2, 1]
    keys = ["f32"] * 6 + ["bf16"] * 2
    plan = plan_buckets(_specs(sizes, owners, keys), cap)
    bucket_keys = [keys[b.members[0]] for b in plan.buckets]
    groups = launch_groups(plan, scatter=True, keys=bucket_keys)
    assert [b for g in groups for b in g.buckets] == list(range(len(plan.buckets)))
    for g in groups:
        assert len({plan.buckets[b].owner for b in g.buckets}) == len(g.buckets)
        assert len({bucket_keys[b] for b in g.buckets}) == 1
        assert g.segment == max(plan.buckets[b].numel for b in g.buckets)
    assert len(groups) < len(plan.buckets)  # some buckets do travel together
    single = launch_groups(plan, scatter=False)
    assert [g.buckets for g in single] == [(b,) for b in range(len(plan.buckets))]


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
    if case == "bad_collective":
        opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
        return catch(ShardedDataParallel, model, opt, ctx.group, collective="all_reduce")
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
    "bad_collective": ("ValueError", "collective must be 'auto', 'reduce' or 'reduce_scatter'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(pool, case):
    kind, text = CASES[case]
    for result in pool.run(bad_input_task, case, world_size=4):
        assert result[0] == kind and text in result[1], result


def test_error_detected_on_one_rank_reaches_every_rank(pool):
    results = pool.run(bad_input_task, "missing_on_one_rank", world_size=2)
    assert results[1][0] == "ValueError" and "extra.weight" in results[1][1]
    assert results[0][0] == "ValueError" and "global rank(s) [1]" in results[0][1]
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


# ----------------------------------------------------------------- DDP's attribute surface
#: Public attributes of DDP (torch) and fairscale's ShardedDataParallel that ours lacks, and why.
#: DDP's list depends on the torch version (torch 2.11 has no ``batched_grad_copy`` and no
#: ``forward_sync_buffers``): the test expects the entries the installed DDP or fairscale has.
ABSENT = {
    "batched_grad_copy": "DDP knob for copying grads into its buckets; owned grads are views",
    "broadcast_bucket_size": "DDP coalesces buffer broadcasts; buffers go one by one here",
    "bucket_bytes_cap": "buckets are sized by bucket_cap_mb (MiB, as DDP) or reduce_buffer_size",
    "bucket_bytes_cap_default": "as bucket_bytes_cap",
    "bucket_bytes_cap_list": "as bucket_bytes_cap",
    "dim": "DDP's input scatter dimension: inputs are not scattered (device_ids is None)",
    "gather": "DDP's output gather for device_ids: outputs are not moved",
    "scatter": "DDP's input scatter for device_ids: inputs are not moved",
    "to_kwargs": "DDP's input move for device_ids: inputs are not moved",
    "use_side_stream_for_tensor_copies": "DDP's input copies for device_ids: none here",
    "skip_all_reduce_unused_params": "DDP knob; unused params are handled by the used flags",
    "forward_sync_buffers": "DDP internal; broadcast_buffers and sync_buffers() here",
    "will_sync_module_buffers": "DDP internal; broadcast_buffers here",
    "modules_buffers": "DDP internal buffer list",
    "named_module_buffers": "DDP internal buffer list",
    "gradient_as_bucket_view": "not an option: owned gradients are always bucket views",
    "join": "uneven inputs (torch Join) are unsupported: ranks run the same backward passes",
    "join_device": "as join",
    "join_hook": "as join",
    "join_process_group": "as join",
    "logger": "DDP's C++ logger object",
    "reducer": "DDP's C++ Reducer object; ours is internal",
    "mixed_precision": "DDP's native mixed precision; use reduce_dtype and torch.autocast",
    "parameters_to_ignore": "no ignore list: freeze params (requires_grad=False) instead",
    "register_comm_hook": "the reduction to owners is the communication; compress with "
    "reduce_dtype / reduce_fp16",
    "require_forward_param_sync": "DDP internal (param sync at forward for multi-device)",
    "static_graph": "no static-graph mode: the plan changes only with params or partition",
}
#: What trainers read from a DDP-like wrapper, with the value DDP has for the same module.
SAME_AS_DDP = (
    "is_multi_device_module",
    "device_type",
    "device",
    "device_ids",
    "output_device",
    "broadcast_buffers",
    "require_backward_grad_sync",
)


def _public(obj, base):
    return {n for n in dir(obj) if not n.startswith("_")} - base


def surface_task(ctx):
    from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
    from fairscale.optim import OSS as FairscaleOSS

    sdp, _, ddp, _ = pair(ctx, 64)
    theirs_model = copy.deepcopy(sdp.module)
    theirs = FairscaleSDP(theirs_model, FairscaleOSS(theirs_model.parameters(), lr=0.1), ctx.group)
    base = _public(torch.nn.Module(), set())
    names = {"ours": _public(sdp, base), "ddp": _public(ddp, base), "fs": _public(theirs, base)}
    values = {n: (getattr(sdp, n), getattr(ddp, n)) for n in SAME_AS_DDP}
    with sdp.no_sync(), ddp.no_sync():
        values["in no_sync"] = (sdp.require_backward_grad_sync, ddp.require_backward_grad_sync)
    values["fairscale"] = {n: (getattr(sdp, n), getattr(theirs, n)) for n in ("device_type",)}
    values["collective"] = sdp.collective  # "auto" on gloo
    # setting require_backward_grad_sync (as DDP's no_sync does) skips the reduction
    sdp.require_backward_grad_sync = False
    sdp(batch(0, ctx.rank)).sum().backward()
    sdp.require_backward_grad_sync = True
    values["kept"] = all(p.grad is not None for p in sdp.module.parameters())
    return names, values


def test_ddp_attribute_surface_with_each_absence_explained(pool):
    pytest.importorskip("fairscale")
    for names, values in pool.run(surface_task, world_size=2):
        theirs = names["ddp"] | names["fs"]
        missing, explained = theirs - names["ours"], set(ABSENT) & theirs
        assert missing == explained, (
            f"not explained: {sorted(missing - explained)}; "
            f"explained but present: {sorted(explained - missing)}"
        )
        assert names["fs"] <= names["ours"]
        for name in SAME_AS_DDP:
            assert name in names["ours"]
            ours, ddp = values[name]
            assert ours == ddp, (name, ours, ddp)
        assert values["in no_sync"] == (False, False)
        assert all(a == b for a, b in values["fairscale"].values())
        assert values["kept"]
        assert values["collective"] == "reduce"
