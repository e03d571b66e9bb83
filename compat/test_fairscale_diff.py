"""Differential suite: fairscale.optim.OSS (0.4.13) against oss_plus.compat.fairscale.OSS.

Every scenario runs the same model, data and calls through both classes on the same ranks and
compares the results exactly (fp32: bit-identical). Where fairscale has a defect listed in
/work/shared/FINDINGS.md, the test shows fairscale failing and the adapter passing.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

pytest.importorskip("fairscale")

from fairscale.optim.oss import OSS as FairscaleOSS  # noqa: E402
from fairscale_cases import CLASSES, build  # noqa: E402
from helpers import (  # noqa: E402 - after importorskip
    SGD_AND_ADAM,
    WORLD_IDS,
    WORLDS,
    KwargSGD,
    clones,
    diff_loss,
    extra_layer_loss,
    flat_double,
    flat_params,
    groups_of,
    index_of,
    load_flat,
    make_diff_model,
    partition_indices,
    same_value,
    train_diff,
    with_extra_layer,
)

from oss_plus.compat import fairscale as compat_fairscale  # noqa: E402
from oss_plus.compat.fairscale import OSS  # noqa: E402

pytestmark = pytest.mark.compat


def _layout(opt, params):
    """Bucket layout: (device, rank) -> (buffer size, [(param index, element offset)])."""
    idx = index_of(params)
    layout = {}
    for device, per_rank in opt.buckets.items():
        for rank, bucket in per_rank.items():
            members = bucket._params if hasattr(bucket, "_params") else bucket.params
            base, size = bucket.buffer.data_ptr(), bucket.buffer.element_size()
            offsets = [(idx(p), (p.data_ptr() - base) // size) for p in members]
            layout[(str(device), rank)] = (bucket.buffer.numel(), offsets)
    return layout


def _describe(opt, params):
    idx = index_of(params)
    return {
        "partition": partition_indices(opt, params, "partition_parameters"),
        "param_to_rank": [opt._param_to_rank[p] for p in params],
        "per_device": {
            str(d): [[idx(p) for p in ps] for ps in per_rank]
            for d, per_rank in opt._per_device_params.items()
        },
        "layout": _layout(opt, params),
        "attributes": (
            opt.world_size,
            opt.rank,
            opt.global_rank,
            type(opt.optim).__name__,
            [len(g["params"]) for g in opt.optim.param_groups],
            [len(g["params"]) for g in opt.param_groups],
            opt.broadcast_fp16,
        ),
    }


def test_constructor_signature_is_fairscales():
    ours = dict(inspect.signature(OSS.__init__).parameters)
    theirs = inspect.signature(FairscaleOSS.__init__).parameters
    # the documented extensions, keyword-only and off by default (docs/integrations.md): a
    # collective state_dict(), and sharding an optimizer that reads across params, which the
    # anchor does silently and oss_plus refuses unless told (docs/optimizers.md)
    for name in ("collective_state_dict", "allow_cross_param"):
        extension = ours.pop(name)
        assert extension.kind is inspect.Parameter.KEYWORD_ONLY and extension.default is False
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


# ------------------------------------------------------------------ parity
def parity_task(ctx, optim_name):
    model = make_diff_model()
    model[0].bias.requires_grad_(False)  # frozen from the start: weighs 1 in the partition
    out = {}
    for kind, m in zip(CLASSES, clones(model, 2)):
        params = list(m.parameters())
        opt = build(kind, groups_of(m), ctx, optim_name)
        result = _describe(opt, params)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        result["losses"] = train_diff(m, opt, 5, scheduler=sched, use_closure=True)
        result["params"] = flat_params(m)
        result["inner_lr"] = [g["lr"] for g in opt.optim.param_groups]
        opt.consolidate_state_dict(recipient_rank=0)
        result["sd"] = opt.state_dict() if ctx.rank == 0 else None
        result["all_states"] = copy.deepcopy(opt._all_states)
        result["sd_all_ranks"] = opt.state_dict(all_ranks=True)
        out[kind] = result
    return out


@pytest.mark.parametrize("optim_name", sorted(SGD_AND_ADAM))
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_partition_layout_training_and_state_dicts_are_identical(pool, world, optim_name):
    """Same partition, bucket layout, params after 5 steps (bit-identical, with param groups,
    a frozen param, a StepLR scheduler and closures), consolidated state, _all_states."""
    results = pool.run(parity_task, optim_name, **world)
    for rank, r in enumerate(results):
        fs, ours = r["fairscale"], r["ours"]
        keys = ("partition", "param_to_rank", "per_device", "layout", "attributes", "losses")
        for key in (*keys, "inner_lr"):
            assert fs[key] == ours[key], f"rank {rank}: {key} differs"
        assert torch.equal(fs["params"], ours["params"]), f"rank {rank}: params differ"
        assert torch.equal(ours["params"], results[0]["ours"]["params"]), "replicas differ"
        assert same_value(fs["all_states"], ours["all_states"]), f"rank {rank}: _all_states"
        assert (len(ours["all_states"]) > 0) == (rank == 0)
        assert same_value(fs["sd_all_ranks"], ours["sd_all_ranks"])
    assert same_value(results[0]["fairscale"]["sd"], results[0]["ours"]["sd"])


def transport_task(ctx, transport):
    """The core's sync transports keep fairscale's addresses modulo 64 bytes."""
    import os

    from oss_plus.wire.sync import TRANSPORT_ENV

    os.environ[TRANSPORT_ENV] = transport
    try:
        out = {}
        for kind, m in zip(CLASSES, clones(make_diff_model(), 2)):
            opt = build(kind, groups_of(m), ctx, "adam")
            train_diff(m, opt, 3)
            out[kind] = flat_params(m)
        out["transports"] = opt.sync_buckets.transports()
    finally:
        del os.environ[TRANSPORT_ENV]
    return out


@pytest.mark.parametrize("transport", ["broadcast", "all_gather"])
def test_bit_identical_on_every_sync_transport(pool, transport):
    results = pool.run(transport_task, transport, world_size=3)
    for r in results:
        assert set(r["transports"]) == {transport}
        assert torch.equal(r["fairscale"], r["ours"])
        assert torch.equal(r["ours"], results[0]["ours"])


def kwargs_task(ctx):
    out = {}
    for kind, m in zip(CLASSES, clones(make_diff_model(), 2)):
        opt = CLASSES[kind](m.parameters(), optim=KwargSGD, group=ctx.group, lr=0.1)

        def closure(m=m, opt=opt):
            opt.zero_grad()
            loss = diff_loss(m, 0)
            loss.backward()
            return loss

        loss = float(opt.step(closure, scale=3.0))
        out[kind] = (
            loss,
            opt.optim.param_groups[0]["seen_scale"],
            opt.param_groups[0]["seen_scale"],
        )
    return out


def test_closure_and_step_kwargs_reach_the_local_optimizer(pool):
    for r in pool.run(kwargs_task, world_size=2):
        assert r["fairscale"] == r["ours"] and r["ours"][1:] == (3.0, 3.0)


# ------------------------------------------------------------------ checkpoints
def save_task(ctx, optim_name):
    sds, params = {}, {}
    for kind, m in zip(CLASSES, clones(make_diff_model(), 2)):
        opt = build(kind, groups_of(m), ctx, optim_name)
        train_diff(m, opt, 3)
        sds[kind], params[kind] = opt.state_dict(all_ranks=True), flat_params(m)
    buffer = io.BytesIO()
    torch.save(sds["fairscale"], buffer)
    buffer.seek(0)  # fairscale's checkpoint loads without pickle
    sds["fairscale_file"] = torch.load(buffer, weights_only=True)
    return sds, params


def load_task(ctx, optim_name, sds, values):
    results = {}
    for loader in CLASSES:
        for source in ("fairscale", "ours", "fairscale_file"):
            model = make_diff_model()
            load_flat(model, values)
            opt = build(loader, groups_of(model), ctx, optim_name)
            sd = copy.deepcopy(sds[source])
            opt.load_state_dict(sd)
            mutated_by_load = not same_value(sd, sds[source])
            train_diff(model, opt, 2, start=3)
            results[(loader, source)] = (
                flat_params(model),
                mutated_by_load,
                not same_value(sd, sds[source]),
            )
    optim, kwargs = SGD_AND_ADAM[optim_name]
    ref = make_diff_model()
    load_flat(ref, values)
    ref_opt = optim(groups_of(ref), **kwargs)
    ref_opt.load_state_dict(copy.deepcopy(sds["fairscale"]))
    train_diff(ref, ref_opt, 2, start=3)
    return results, flat_params(ref)


@pytest.mark.parametrize("save_world,load_world", [(2, 3), (4, 1)])
def test_checkpoints_cross_load_both_ways_at_another_world_size(pool, save_world, load_world):
    """fairscale -> ours and ours -> fairscale at another world size continue bit-identically;
    fairscale's load_state_dict mutates the caller's dict or aliases its tensors (#6)."""
    saved = pool.run(save_task, "adam", world_size=save_world)[0]
    sds, params = saved
    assert torch.equal(params["fairscale"], params["ours"])
    assert same_value(sds["fairscale"], sds["ours"])
    for results, ref in pool.run(load_task, "adam", sds, params["ours"], world_size=load_world):
        first = results[("fairscale", "fairscale")][0]
        for key, (values, mutated_by_load, mutated_later) in results.items():
            assert torch.equal(values, first), key
            if key[0] == "ours":
                assert not mutated_by_load and not mutated_later, key
            else:  # fairscale: entries of other ranks become {}, owned tensors are aliased
                assert mutated_later, key
                assert mutated_by_load == (load_world > 1), key
        assert torch.allclose(first, ref, rtol=0, atol=1e-6)  # unaligned layout: not bit-exact


# ------------------------------------------------------------------ groups and trainability
def add_group_task(ctx, freeze_before_add):
    out = {}
    for kind, m, e in with_extra_layer((*CLASSES, "reference")):
        if kind == "reference":
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        else:
            opt = build(kind, list(m.parameters()), ctx)
        for step in range(5):
            if step == 2:
                if freeze_before_add:
                    m[0].weight.requires_grad_(False)
                opt.add_param_group({"params": list(e.parameters()), "lr": 0.05})
            opt.zero_grad()
            extra_layer_loss(m, e, step).backward()
            opt.step()
        params = [*m.parameters(), *e.parameters()]
        out[kind] = {"params": flat_double(params)}
        if kind != "reference":
            out[kind]["partition"] = partition_indices(opt, params, "partition_parameters")
    return out


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[2]], ids=["ws2", "ws3"])
def test_add_param_group_is_identical(pool, world):
    for r in pool.run(add_group_task, False, **world):
        assert r["fairscale"]["partition"] == r["ours"]["partition"]
        assert torch.equal(r["fairscale"]["params"], r["ours"]["params"])


def test_add_param_group_after_requires_grad_change_loses_updates_in_fairscale(pool):
    """fairscale #3: the repartition moves params with state; their updates are lost."""
    for r in pool.run(add_group_task, True, world_size=2):
        ref = r["reference"]["params"]
        assert (r["fairscale"]["params"] - ref).abs().max() > 1e-3  # the defect
        assert torch.allclose(r["ours"]["params"], ref, rtol=0, atol=1e-6)


def refresh_task(ctx):
    model = make_diff_model()
    out = {}
    for kind, m in zip((*CLASSES, "reference"), clones(model, 3)):
        params = list(m.parameters())
        opt = build_or_plain(kind, params, ctx)
        train_diff(m, opt, 2)
        before = partition_indices(opt, params, "partition_parameters") if kind in CLASSES else []
        m[0].requires_grad_(False)
        m[2].requires_grad_(False)
        if kind in CLASSES:
            opt.refresh_trainable()
        after = partition_indices(opt, params, "partition_parameters") if kind in CLASSES else []
        twin = list(copy.deepcopy(m).parameters())  # same trainability, own storage
        fresh = FairscaleOSS(twin, optim=torch.optim.SGD, group=ctx.group, lr=0.1)
        train_diff(m, opt, 3, start=2)
        fresh_parts = partition_indices(fresh, twin, "partition_parameters")
        out[kind] = (before, after, fresh_parts, flat_params(m))
    return out


def build_or_plain(kind, params, ctx):
    """:func:`fairscale_cases.build`'s SGD, or the plain torch SGD for ``"reference"``."""
    if kind == "reference":
        optim, kwargs = SGD_AND_ADAM["sgd"]
        return optim(params, **kwargs)
    return build(kind, params, ctx)


def test_refresh_trainable_repartitions(pool):
    """fairscale #4: refresh_trainable() keeps the stale partition; ours repartitions exactly
    as a fairscale OSS built for the new trainability would, and trains like plain SGD."""
    for r in pool.run(refresh_task, world_size=3):
        before, after, fresh, _ = r["fairscale"]
        assert after == before != fresh  # the defect
        _, ours_after, ours_fresh, params = r["ours"]
        assert ours_after == ours_fresh
        # fairscale's bucket layout changes the matmuls' rounding: not bit-identical to plain
        assert torch.allclose(params, r["reference"][3], rtol=0, atol=1e-6), "not plain SGD"


def unfreeze_task(ctx):
    model = make_diff_model()
    model[4].weight.requires_grad_(False)
    out = {}
    for kind, m in zip((*CLASSES, "reference"), clones(model, 3)):
        opt = build_or_plain(kind, list(m.parameters()), ctx)
        train_diff(m, opt, 1)
        m[4].weight.requires_grad_(True)  # no refresh_trainable() call
        train_diff(m, opt, 2, start=1)
        out[kind] = flat_params(m)
    return out


def test_unfreezing_without_refresh_trainable_keeps_replicas_in_sync(pool):
    """fairscale never sends a param unfrozen after construction unless refresh_trainable()
    is called: the replicas silently diverge. Ours detects the change at step() and every
    rank equals the plain optimizer."""
    results = pool.run(unfreeze_task, world_size=2)
    assert not torch.equal(results[0]["fairscale"], results[1]["fairscale"])  # the defect
    for r in results:
        assert torch.allclose(r["ours"], r["reference"], rtol=0, atol=1e-6), "not plain SGD"


# ------------------------------------------------------------------ integrations
def sharded_ddp_task(ctx):
    from fairscale.nn.data_parallel import ShardedDataParallel

    out = {}
    for kind, m in zip(CLASSES, clones(make_diff_model(), 2)):
        opt = build(kind, m.parameters(), ctx, "adam")
        ddp = ShardedDataParallel(m, opt, process_group=ctx.group)
        for step in range(3):
            opt.zero_grad()
            diff_loss(ddp, step, rank=ctx.rank).backward()
            opt.step()
        out[kind] = flat_params(m)
    return out


def test_sharded_ddp_drives_ours_exactly_like_fairscale(pool):
    results = pool.run(sharded_ddp_task, world_size=2)
    for r in results:
        assert torch.equal(r["fairscale"], r["ours"])
        assert torch.equal(r["ours"], results[0]["ours"])


def test_install_makes_fairscale_imports_resolve_to_ours():
    import fairscale.optim
    import fairscale.optim.oss

    assert compat_fairscale.is_installed() is None
    try:
        assert compat_fairscale.install() == "patched"
        assert compat_fairscale.install() == "patched"  # idempotent
        from fairscale.optim import OSS as from_package
        from fairscale.optim.oss import OSS as from_module

        assert from_package is from_module is OSS
    finally:
        compat_fairscale.uninstall()
    assert fairscale.optim.OSS is FairscaleOSS
    assert fairscale.optim.oss.OSS is FairscaleOSS
    assert compat_fairscale.is_installed() is None


def patched_real_task(ctx):
    """While installed, fairscale's own class (its methods look up OSS in their module)
    still works and still matches ours."""
    out = {}
    compat_fairscale.install()
    try:
        for kind, m in zip(CLASSES, clones(make_diff_model(), 2)):
            train_diff(m, build(kind, m.parameters(), ctx), 2)
            out[kind] = flat_params(m)
    finally:
        compat_fairscale.uninstall()
    return out


def test_fairscale_class_still_works_while_installed(pool):
    for r in pool.run(patched_real_task, world_size=2):
        assert torch.equal(r["fairscale"], r["ours"])
