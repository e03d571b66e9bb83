"""oss_plus.compat.fairscale.OSS on its own (fairscale need not be installed).

The comparison with the real fairscale class is in compat/test_fairscale_diff.py.
"""

import inspect
import math

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
    train,
)

from oss_plus.compat._base import CompatOSS
from oss_plus.compat.fairscale import ALL_STATES_READ_ONLY, OSS
from oss_plus.optimizer import NOT_CONSOLIDATED


def test_constructor_signature_is_fairscale_0_4_13s():
    params = dict(inspect.signature(OSS.__init__).parameters)
    for name in ("collective_state_dict", "allow_cross_param"):  # keyword-only, off by default
        extension = params.pop(name)
        assert extension.kind is inspect.Parameter.KEYWORD_ONLY and extension.default is False
    assert [(p.name, p.default) for p in params.values()] == [
        ("self", inspect.Parameter.empty),
        ("params", inspect.Parameter.empty),
        ("optim", torch.optim.SGD),
        ("group", None),
        ("broadcast_buffer_size", -1),
        ("broadcast_fp16", False),
        ("force_broadcast_object", False),
        ("default", inspect.Parameter.empty),
    ]
    assert params["default"].kind is inspect.Parameter.VAR_KEYWORD


def test_adapter_is_built_on_the_core_not_on_fairscale():
    assert issubclass(OSS, CompatOSS)
    assert not [c for c in OSS.__mro__ if c.__module__.split(".")[0] == "fairscale"]


# ------------------------------------------------------------------ training and layout
def parity_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    groups = [
        {"params": list(model.parameters())[::2]},
        {"params": list(model.parameters())[1::2], "lr": 0.03},
    ]
    ref_groups = [
        {"params": list(ref_model.parameters())[::2]},
        {"params": list(ref_model.parameters())[1::2], "lr": 0.03},
    ]
    opt = OSS(groups, optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    ref = torch.optim.Adam(ref_groups, lr=0.01)
    train(model, opt, 4)
    train(ref_model, ref, 4)
    return flat_params(model), flat_params(ref_model)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_training_matches_the_plain_optimizer(pool, world):
    """fairscale's unaligned layout makes matmuls round differently: equal to ~1e-7."""
    results = pool.run(parity_task, **world)
    for params, ref in results:
        assert torch.allclose(params, ref, rtol=0, atol=1e-6)
        assert torch.equal(params, results[0][0])  # replicas identical


def layout_task(ctx):
    model = make_model()
    frozen = list(model.parameters())[1]
    frozen.requires_grad_(False)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    out = {"devices": [str(d) for d in opt.buckets], "buckets": {}}
    for rank, bucket in opt.buckets[torch.device("cpu")].items():
        base = bucket.buffer.data_ptr()
        offsets = [(p.data_ptr() - base) // 4 for p in bucket.params]
        sizes = [p.numel() for p in bucket.params]
        out["buckets"][rank] = (
            offsets,
            sizes,
            bucket.buffer.numel(),
            any(p is frozen for p in bucket.params),
        )
    per_device = opt._per_device_params[torch.device("cpu")]
    out["per_device_sizes"] = [[p.numel() for p in ps] for ps in per_device]
    out["per_device_all"] = sorted(id(p) for ps in per_device for p in ps) == sorted(
        id(p) for p in model.parameters()
    )
    out["to_rank"] = [opt._param_to_rank[p] for p in model.parameters()]
    out["partition"] = [
        [[opt._param_to_index[id(p)] for p in g["params"]] for g in groups]
        for groups in opt.partition_parameters()
    ]
    return out


def test_buckets_pack_trainable_params_back_to_back_in_ascending_size(pool):
    for r in pool.run(layout_task, world_size=2):
        assert r["devices"] == ["cpu"]
        for offsets, sizes, total, has_frozen in r["buckets"].values():
            assert sizes == sorted(sizes) and not has_frozen
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]  # no padding
            assert total == sum(sizes)
        for rank, sizes in enumerate(r["per_device_sizes"]):
            assert sizes == sorted(sizes)
            assert len(sizes) == r["to_rank"].count(rank)
        assert r["per_device_all"]  # frozen params listed too
        flat_owner = [rank for rank, groups in enumerate(r["partition"]) for g in groups for _ in g]
        assert sorted(flat_owner) == sorted(r["to_rank"])


def local_params_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    before = len(opt._local_params)  # fairscale caches this list: empty forever
    backward(model, 0)
    owned = {id(p) for p, r in opt._param_to_rank.items() if r == ctx.rank}
    after = {id(p) for p in opt._local_params}
    return before, after == owned, opt._default_device, opt.backend, opt._local_to_global_rank


def test_local_params_are_computed_at_every_access(pool):
    for before, fresh, device, backend, to_global in pool.run(local_params_task, ranks=(2, 3)):
        assert before == 0 and fresh
        assert device == torch.device("cpu") and backend == "gloo"
        assert to_global == [2, 3]


# ------------------------------------------------------------------ state dicts
def all_states_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    out = {"before": catch(opt.state_dict)}
    train(model, opt, 2)
    opt.consolidate_state_dict(recipient_rank=1)
    out["all_states"] = opt._all_states
    out["sd"] = catch(opt.state_dict)
    out["partition"] = [
        [[opt._param_to_index[id(p)] for p in g["params"]] for g in groups]
        for groups in opt.partition_parameters()
    ]
    out["assign_list"] = catch(setattr, opt, "_all_states", [{}])
    opt._all_states = []  # the documented way to free the consolidated copy
    out["dropped"] = catch(opt.state_dict)
    opt.consolidate_state_dict(recipient_rank=-1)
    train(model, opt, 1, start=2)
    out["after_step"] = catch(opt.state_dict)
    return out


def test_all_states_is_fairscales_per_rank_format(pool):
    results = pool.run(all_states_task, world_size=3)
    for rank, r in enumerate(results):
        assert r["before"] == ("RuntimeError", NOT_CONSOLIDATED.format(rank=rank))
        assert r["after_step"][0] == "RuntimeError"  # dropped at the next step
        assert r["assign_list"] == ("ValueError", ALL_STATES_READ_ONLY.format(kind="list"))
        if rank != 1:
            assert r["all_states"] == [] and r["sd"][0] == "RuntimeError"
            continue
        assert r["dropped"][0] == "RuntimeError"
        sd = r["sd"][1]
        assert len(r["all_states"]) == 3
        for local, groups in zip(r["all_states"], r["partition"]):
            flat_owned = [i for g in groups for i in g]
            assert [g["params"] for g in local["param_groups"]] == [
                list(range(sum(map(len, groups[:k])), sum(map(len, groups[: k + 1]))))
                for k in range(len(groups))
            ]
            assert local["param_groups"][0]["lr"] == sd["param_groups"][0]["lr"]
            for position, index in enumerate(flat_owned):
                for key, value in sd["state"][index].items():
                    assert torch.equal(local["state"][position][key], value)


def load_task(ctx, sd):
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    return loads_without_touching(model, opt, sd)


def test_load_state_dict_never_mutates_the_callers_dict(pool):
    """fairscale #6: fairscale empties the entries of other ranks and aliases the rest."""
    model = make_model()
    ref = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, ref, 2)
    assert all(pool.run(load_task, ref.state_dict(), world_size=3))


# ------------------------------------------------------------------ wire, trainability
def fp16_task(ctx):
    params = [torch.nn.Parameter(torch.ones(16)) for _ in range(4)]
    opt = OSS(params, group=ctx.group, lr=1e-4)
    opt.broadcast_fp16 = True
    for _ in range(3):
        opt.zero_grad()
        sum(p.sum() for p in params).backward()
        opt.step()
    return [(opt._param_to_rank[p], p.detach().clone()) for p in params]


def test_broadcast_fp16_keeps_exact_main_values_and_identical_replicas(pool):
    """Every rank, the owner included, holds the fp32 trajectory rounded to fp16 (fairscale
    rounds the owner's own weights, and a 1e-4 update is lost)."""
    exact = torch.ones(16) - 1e-4 - 1e-4 - 1e-4
    for result in pool.run(fp16_task, world_size=2):
        for _, value in result:
            assert torch.equal(value, exact.half().float())
            assert not torch.equal(value, torch.ones(16))


def refresh_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    inner = opt.optim
    opt.refresh_trainable()  # nothing changed: same partition, same inner optimizer
    kept = opt.optim is inner
    train(model, opt, 2)
    train(ref_model, ref, 2)
    for m in (model, ref_model):
        m[0].requires_grad_(False)
    opt.refresh_trainable()
    twin = clone_model(model)
    fresh = OSS(twin.parameters(), group=ctx.group, lr=0.1)
    same_partition = [opt._param_to_rank[p] for p in model.parameters()] == [
        fresh._param_to_rank[p] for p in twin.parameters()
    ]
    train(model, opt, 2, start=2)
    train(ref_model, ref, 2, start=2)
    close = torch.allclose(flat_params(model), flat_params(ref_model), rtol=0, atol=1e-6)
    return kept, same_partition, close, flat_params(model)


def test_refresh_trainable_repartitions_and_keeps_the_state(pool):
    """fairscale #4: refresh_trainable() repartitions; momentum survives the move."""
    results = pool.run(refresh_task, world_size=3)
    for kept, same_partition, close, params in results:
        assert kept and same_partition and close
        assert torch.equal(params, results[0][3])


# ------------------------------------------------------------------ clipping
def clip_task(ctx):
    pair = ctx.groups[(0, 1)] if ctx.global_rank < 2 else ctx.groups[(2, 3)]
    model = make_model()
    ref = clone_model(model)
    opt = OSS(model.parameters(), group=pair, lr=0.1)
    backward(model, 0)
    backward(ref, 0)
    world = float(opt.clip_grad_norm(1e9))
    own_group = float(opt.clip_grad_norm(0.01, group=opt.group))
    ref_total = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    owned = [p for p, r in opt._param_to_rank.items() if r == opt.rank]
    clipped = all(
        torch.allclose(p.grad, q.grad, rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), ref.parameters())
        if any(p is o for o in owned)
    )
    counted = float(opt.clip_grad_norm(1e9, filter_params_fn=lambda ps: ps[:1], group=opt.group))
    first_owned = [p for p in model.parameters() if any(p is o for o in owned)][:1]
    return (
        world,
        own_group,
        ref_total,
        clipped,
        counted,
        sum(float(p.grad.norm()) ** 2 for p in first_owned),
    )


def test_clip_grad_norm_reduces_over_world_like_fairscale(pool):
    """fairscale's documented semantics: WORLD (two independent pairs: sqrt(2) too large);
    group= restricts it to the optimizer's ranks; filter_params_fn selects what counts."""
    results = pool.run(clip_task, ranks=(0, 1, 2, 3))
    for world, own_group, ref_total, clipped, _, _ in results:
        assert world == pytest.approx(ref_total * math.sqrt(2), rel=1e-5)
        assert own_group == pytest.approx(ref_total, rel=1e-5)
        assert clipped and ref_total > 0.01
    for pair in ((0, 1), (2, 3)):
        squares = sum(results[r][5] for r in pair)
        assert results[pair[0]][4] == pytest.approx(math.sqrt(squares), rel=1e-5)


# ------------------------------------------------------------------ errors
def different_models_task(ctx):
    return catch(OSS, make_model(width=6 + ctx.rank).parameters(), group=ctx.group, lr=0.1)[0]


def test_different_models_raise_on_every_rank(pool):
    """fairscale #8: gloo aborts; here every rank raises."""
    assert pool.run(different_models_task, world_size=2) == ["ValueError", "ValueError"]


def scaler_task(ctx):
    from oss_plus.amp.scaler import ShardedGradScaler

    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    before = flat_params(model)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    if ctx.rank == 0:
        next(model.parameters()).grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), torch.equal(before, flat_params(model))


def test_an_inf_on_one_rank_skips_the_step_everywhere_with_the_sharded_scaler(pool):
    """fairscale #9 (a hang with torch's GradScaler): every rank skips, no rank hangs."""
    assert pool.run(scaler_task, world_size=2, timeout=30) == [(2.0, True), (2.0, True)]


def test_sync_param_groups_copies_everything_but_params():
    source = [{"params": [1], "lr": 0.5, "new": 1}]
    destination = [{"params": [2], "lr": 0.1}]
    CompatOSS._sync_param_groups(source, destination)
    assert destination == [{"params": [2], "lr": 0.5, "new": 1}]
    assert OSS._sync_param_groups is CompatOSS._sync_param_groups
