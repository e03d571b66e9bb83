"""oss_plus.compat.torch.ZeroRedundancyOptimizer on its own.

The comparison with torch's class is in compat/test_torch_diff.py.
"""

import copy

import pytest
import torch
from helpers import (
    WORLD_IDS,
    WORLDS,
    backward,
    catch,
    clone_model,
    flat_params,
    loads_without_touching,
    make_model,
    mixed_dtype_training,
    params_equal,
    state_equal,
    train,
)
from torch.distributed.algorithms.join import Join, Joinable

from oss_plus import OSS
from oss_plus.compat.torch import (
    PARAMS_EMPTY,
    ZeroRedundancyOptimizer,
)


def test_is_built_on_the_core_and_joinable_not_on_torchs_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    assert issubclass(ZeroRedundancyOptimizer, OSS)
    assert issubclass(ZeroRedundancyOptimizer, Joinable)
    assert TorchZero not in ZeroRedundancyOptimizer.__mro__  # only a virtual subclass


# ------------------------------------------------------------------ construction
def overlap_task(ctx):
    return catch(
        ZeroRedundancyOptimizer,
        make_model().parameters(),
        torch.optim.SGD,
        process_group=ctx.group,
        overlap_with_ddp=True,
        lr=0.1,
    )


def test_overlap_with_ddp_constructs(pool):
    """Delivered by issue 8: the hooks are tested in compat/test_overlap_diff.py."""
    for result in pool.run(overlap_task, world_size=2):
        assert result[0] == "ok"


def one_bad_rank_task(ctx):
    params = [] if ctx.rank == 1 else list(make_model().parameters())
    return catch(ZeroRedundancyOptimizer, params, torch.optim.SGD, process_group=ctx.group, lr=0.1)


def test_bad_params_on_one_rank_raise_on_every_rank(pool):
    results = pool.run(one_bad_rank_task, world_size=3, timeout=30)
    assert results[1] == ("ValueError", PARAMS_EMPTY)
    assert results[0][0] == results[2][0] == "ValueError" and "[1]" in results[0][1]
    assert PARAMS_EMPTY in results[0][1] and PARAMS_EMPTY in results[2][1]


def named_class_task(ctx, name, other):
    """Train with ``optimizer_class`` given as a name (``other`` on rank 1) against the
    plain torch.optim class named."""
    torch.manual_seed(0)
    model = make_model()
    ref = clone_model(model)
    given = other if ctx.rank == 1 else name
    made = catch(ZeroRedundancyOptimizer, model.parameters(), given, ctx.group, lr=0.01)
    if made[0] != "ok":
        return made
    opt = made[1]
    ref_opt = getattr(torch.optim, name)(ref.parameters(), lr=0.01)
    train(model, opt, 3)
    train(ref, ref_opt, 3)
    return (type(opt.optim).__name__, params_equal(model, ref))


def test_optimizer_class_may_be_a_torch_optim_name(pool):
    """What config files pass (mmengine's ``optimizer_type='AdamW'``): trains exactly as the
    class named."""
    for result in pool.run(named_class_task, "AdamW", "AdamW", world_size=2):
        assert result == ("AdamW", True)


def test_an_unknown_optimizer_name_raises_on_every_rank_naming_the_accepted_ones(pool):
    for result in pool.run(named_class_task, "AdamW", "Adamw", world_size=2, timeout=30):
        assert result[0] == "ValueError", result
        assert "'Adamw' is not a torch.optim optimizer" in result[1], result
        assert "'AdamW'" in result[1] and "'SGD'" in result[1]  # the accepted names


# ------------------------------------------------------------------ training and layout
def parity_task(ctx, bucket_view):
    model = make_model()
    ref_model = clone_model(model)
    storage = [p.data_ptr() for p in model.parameters()]
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        process_group=ctx.group,
        parameters_as_bucket_view=bucket_view,
        lr=0.01,
    )
    untouched = storage == [p.data_ptr() for p in model.parameters()]
    train(model, opt, 3)
    train(ref_model, torch.optim.Adam(ref_model.parameters(), lr=0.01), 3)
    views = []
    for bucket in opt.sync_buckets.buckets:
        start = bucket.buffer.data_ptr()
        views.append([((p.data_ptr() - start) // 4, p.numel()) for p in bucket.params])
    return untouched, flat_params(model), flat_params(ref_model), views


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_per_param_mode_is_bit_exact_and_keeps_param_storage(pool, world):
    results = pool.run(parity_task, False, **world)
    for untouched, params, ref, _ in results:
        assert untouched and torch.equal(params, ref)
        assert torch.equal(params, results[0][1])


def test_bucket_views_pack_params_back_to_back_largest_first(pool):
    results = pool.run(parity_task, True, world_size=2)
    for untouched, params, ref, views in results:
        assert not untouched
        assert torch.allclose(params, ref, rtol=0, atol=1e-6)  # unaligned views, as torch
        assert torch.equal(params, results[0][1])
        for members in views:
            offsets, sizes = zip(*members)
            assert list(sizes) == sorted(sizes, reverse=True)
            assert list(offsets) == [sum(sizes[:i]) for i in range(len(sizes))]


def join_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, process_group=ctx.group, lr=0.1
    )
    with Join([opt]):
        for step in range(1 + ctx.rank):  # uneven inputs, no DDP
            opt.zero_grad()
            backward(model, step)
            opt.step()
    owners = [opt.param_to_rank[p] for p in model.parameters()]
    hook = opt.join_hook()
    return (
        flat_params(model),
        joined_reference(ref_model, owners, ctx.world_size),
        opt.join_device,
        opt.join_process_group is ctx.group,
        type(hook).__name__,
    )


def joined_reference(model, owners, world_size, lr=0.1):
    """Plain SGD by hand for :func:`join_task`: rank ``r`` has ``r + 1`` batches; once out of
    inputs its shadow step re-applies the gradients of its last batch to the params it owns
    (as torch's hook, which calls ``step()``)."""
    grads = []
    for step in range(world_size):
        model.zero_grad()
        backward(model, step)
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, (p, owner) in enumerate(zip(model.parameters(), owners)):
                p.add_(grads[min(step, owner)][i], alpha=-lr)
    return flat_params(model)


def test_join_with_uneven_inputs_does_not_hang(pool):
    results = pool.run(join_task, world_size=3, timeout=30)
    for params, ref, device, same_group, hook in results:
        assert torch.equal(params, ref), "differs from plain SGD with the joined ranks' steps"
        assert device == torch.device("cpu") and same_group and hook == "_ZeroJoinHook"


# ------------------------------------------------------------------ groups and trainability
def added_frozen_task(ctx):
    model = make_model()
    extra = torch.nn.Linear(6, 6)
    ref_model, ref_extra = clone_model(model), clone_model(extra)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.SGD,
        process_group=ctx.group,
        parameters_as_bucket_view=True,
        lr=0.1,
    )
    inner = opt.optim
    extra.requires_grad_(False)
    opt.add_param_group({"params": list(extra.parameters())})
    ref.add_param_group({"params": list(ref_extra.parameters())})
    extra.requires_grad_(True)
    for step in range(2):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
        for m, e, o in ((model, extra, opt), (ref_model, ref_extra, ref)):
            o.zero_grad()
            m(e(x)).sum().backward()
            o.step()
    exact = torch.equal(flat_params(extra), flat_params(ref_extra)) and torch.equal(
        flat_params(model), flat_params(ref_model)
    )
    return exact, len(opt._all_params), opt.optim is inner


def test_group_added_frozen_then_unfrozen_is_broadcast(pool):
    """torch #1: the new params' trainability is tracked; every rank equals plain SGD."""
    for exact, count, kept in pool.run(added_frozen_task, world_size=2):
        assert exact, "differs from plain SGD (the added group was not stepped or not synced)"
        assert count == 8 + 2 and kept


# ------------------------------------------------------------------ state dicts
def state_task(ctx, sd):
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, process_group=ctx.group, lr=0.01, fused=True
    )
    ref_model = clone_model(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, fused=True)
    unchanged = loads_without_touching(model, opt, sd)
    ref.load_state_dict(copy.deepcopy(sd))
    train(ref_model, ref, 1)
    params_exact = torch.equal(flat_params(model), flat_params(ref_model))
    no_none = not any(v is None for v in opt.state.values())
    fused_step = {s["step"].device.type for s in opt.optim.state.values()}
    opt.consolidate_state_dict(to=1)
    mine = catch(opt.state_dict)
    local = opt._all_state_dicts
    bad_to = catch(opt.consolidate_state_dict, to=ctx.world_size)[0]
    torch.distributed.barrier(group=ctx.group)  # each rank's optimizer lives until all read
    return unchanged, no_none, fused_step, mine, local, bad_to, params_exact, ref.state_dict()


def test_state_dict_round_trip_with_fused_adamw(pool):
    """torch #2: the caller's dict is not mutated, no None in .state; torch #3: a fused AdamW
    state reloads (0-dim step kept where the fused kernel wants it)."""
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    train(model, ref, 2)
    results = pool.run(state_task, ref.state_dict(), world_size=3)
    for unchanged, no_none, fused_step, mine, local, bad_to, exact, ref_sd in results:
        assert unchanged and no_none and fused_step == {"cpu"}
        assert exact, "the reloaded fused AdamW does not step like the plain one"
        assert bad_to == "ValueError"
        # rank 1 consolidated; the others read the shards themselves (issue 56), where
        # torch's class raises
        assert mine[0] == "ok"
        sd = mine[1]
        assert state_equal(sd, ref_sd), "consolidated state differs from the plain AdamW's"
        assert len(local) == 3 and sorted(sd["state"]) == list(range(8))
        assert sum(len(s["state"]) for s in local) == 8
        assert all(t.device.type == "cpu" for s in sd["state"].values() for t in s.values())


def trainability_task(ctx):
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, process_group=ctx.group, lr=0.1
    )
    ref_model = clone_model(model)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    inner = opt.optim
    owners = [opt._param_to_rank[p] for p in model.parameters()]
    for m, o in ((model, opt), (ref_model, ref)):
        train(m, o, 1)
        m[0].requires_grad_(False)
        train(m, o, 1, start=1)
    same_owners = owners == [opt._param_to_rank[p] for p in model.parameters()]
    return opt.optim is inner, same_owners, params_equal(model, ref_model)


def test_freezing_keeps_the_partition_and_the_local_optimizer(pool):
    results = pool.run(trainability_task, world_size=2)
    for kept, same_owners, exact in results:
        assert kept and same_owners
        assert exact, "differs from plain SGD with the same param frozen"


def mixed_dtype_task(ctx):
    def make(kind, params):
        if kind == "reference":
            return torch.optim.Adam(params, lr=0.1)
        return ZeroRedundancyOptimizer(
            params,
            torch.optim.Adam,
            process_group=ctx.group,
            parameters_as_bucket_view=True,
            lr=0.1,
        )

    out = mixed_dtype_training(make, ("ours", "reference"))
    status, params = out["ours"]
    return status == "ok" and all(torch.equal(a, b) for a, b in zip(params, out["reference"][1]))


def test_mixed_dtypes_are_supported(pool):
    """torch #5: torch raises ValueError for mixed dtypes."""
    assert all(pool.run(mixed_dtype_task, world_size=2))
