"""The flat partition rule in OSS: pieces stepped on several ranks, compared with the
unsharded torch optimizer (bit for bit in fp32), on 1-4 ranks and an offset subgroup."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    WORLD_IDS,
    WORLDS,
    backward,
    batch,
    clone_model,
    flat_params,
    groups_of,
    loss_of,
    make_cut_model,
    make_model,
    train_in_lockstep,
)

import oss_plus
from oss_plus import OSS
from oss_plus.wire.changes import WINDOWS

#: Every class the flat rule accepts out of the box, with stateful settings.
ELEMENTWISE = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam_fused": (torch.optim.Adam, {"lr": 0.01, "fused": True}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "foreach": False}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamax": (torch.optim.Adamax, {"lr": 0.01}),
    "nadam": (torch.optim.NAdam, {"lr": 0.01}),
    "radam": (torch.optim.RAdam, {"lr": 0.01}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
}


def _flat(model, ctx, optim=torch.optim.Adam, two_groups=False, **kwargs):
    kwargs = kwargs or {"lr": 0.01}
    groups = groups_of(model, two_groups)
    return OSS(groups, optim=optim, group=ctx.group, partition_rule="flat", **kwargs)


def parity_task(ctx, two_groups, steps=3):
    out = {}
    for name, (optim, kwargs) in ELEMENTWISE.items():
        model = make_model(depth=4)
        ref_model = clone_model(model)
        opt = _flat(model, ctx, optim, two_groups, **kwargs)
        ref = optim(groups_of(ref_model, two_groups), **kwargs)
        exact = train_in_lockstep(model, opt, ref_model, ref, steps)
        owned = [p.numel() for g in opt.optim.param_groups for p in g["params"]]
        out[name] = {"exact": exact, "params": flat_params(model), "owned": owned}
    out["split"] = len(opt.plan.split)
    return out


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_bit_identical_to_the_unsharded_optimizer(pool, world):
    results = pool.run(parity_task, False, **world)
    total = results[0]["adam"]["params"].numel()
    if len(results) > 1:
        assert results[0]["split"] > 0, "the model must be cut inside params"
    for name in ELEMENTWISE:
        for rank, r in enumerate(results):
            assert all(r[name]["exact"]), f"{name}: rank {rank} diverged: {r[name]['exact']}"
            assert torch.equal(r[name]["params"], results[0][name]["params"]), "replicas differ"
        owned = [sum(r[name]["owned"]) for r in results]
        assert sum(owned) == total  # every element stepped exactly once
        assert max(owned) <= -(-total // len(results)) + 16 * len(results)


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
def test_two_groups_with_different_lrs(pool, world):
    for r in pool.run(parity_task, True, **world):
        assert all(all(v["exact"]) for k, v in r.items() if k != "split")


def state_task(ctx):
    model = make_model(depth=4)
    ref_model = clone_model(model)
    opt = _flat(model, ctx, torch.optim.Adam, True, lr=0.01)
    ref = torch.optim.Adam(groups_of(ref_model, True), lr=0.01)
    train_in_lockstep(model, opt, ref_model, ref, 2)
    opt.consolidate_state_dict(recipient_rank=0)
    sd = copy.deepcopy(opt.state_dict()) if ctx.rank == 0 else None
    everywhere = copy.deepcopy(opt.state_dict(all_ranks=True))  # torch's aliases live state
    expected = copy.deepcopy(ref.state_dict())
    # the consolidated dict loads into a plain torch optimizer and continues exactly
    plain_model = clone_model(model)
    plain = torch.optim.Adam(groups_of(plain_model, True), lr=0.01)
    plain.load_state_dict(copy.deepcopy(everywhere))  # torch keeps the step tensors
    exact = train_in_lockstep(plain_model, plain, ref_model, ref, 2)
    return {"sd": sd, "all": everywhere, "expected": expected, "continued": exact}


def _same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i, s in a["state"].items():
        assert sorted(s) == sorted(b["state"][i])
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)
            if isinstance(v, torch.Tensor):
                assert v.shape == b["state"][i][k].shape


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_state_dict_stitches_the_pieces_into_torchs_format(pool, world):
    results = pool.run(state_task, **world)
    _same_state(results[0]["sd"], results[0]["expected"])
    for r in results:
        _same_state(r["all"], r["expected"])
        assert all(r["continued"])


def load_task(ctx, saved):
    """Load a plain torch optimizer's state dict (any world size), then continue exactly."""
    model = make_model(depth=4)
    ref_model = clone_model(model)
    opt = _flat(model, ctx, torch.optim.AdamW, True, lr=0.01)
    ref = torch.optim.AdamW(groups_of(ref_model, True), lr=0.01)
    ref.load_state_dict(saved)
    opt.load_state_dict(saved)
    return train_in_lockstep(model, opt, ref_model, ref, 3)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_load_state_dict_of_the_unsharded_optimizer(pool, world):
    model = make_model(depth=4)
    ref = torch.optim.AdamW(groups_of(model, True), lr=0.01)
    for step in range(2):
        ref.zero_grad()
        backward(model, step + 10)
        ref.step()
    for exact in pool.run(load_task, ref.state_dict(), **world):
        assert all(exact)


def refresh_task(ctx):
    """Freeze the first layer after 2 steps, add a group later: state follows the pieces."""
    model = make_model(depth=4)
    extra = torch.nn.Linear(1, 1)
    ref_model, ref_extra = clone_model(model), clone_model(extra)
    opt = _flat(model, ctx, torch.optim.Adam, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    exact = train_in_lockstep(model, opt, ref_model, ref, 2)
    cuts = [opt.plan.pieces]
    for m in (model, ref_model):
        m[0].weight.requires_grad_(False)
    exact += train_in_lockstep(model, opt, ref_model, ref, WINDOWS)  # a freeze: within WINDOWS
    cuts.append(opt.plan.pieces)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.1})
    ref.add_param_group({"params": list(ref_extra.parameters()), "lr": 0.1})
    exact += train_in_lockstep(model, opt, ref_model, ref, 2)
    _same_state(opt.state_dict(all_ranks=True), ref.state_dict())
    return {"exact": exact, "cuts": cuts}


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_refresh_trainable_and_add_param_group_move_the_pieces_state(pool, world):
    results = pool.run(refresh_task, **world)
    for r in results:
        assert all(r["exact"]), r["exact"]
    if len(results) > 1:
        assert results[0]["cuts"][0] != results[0]["cuts"][1], "the cut must move"


def clip_task(ctx, norm_type, filtered):
    model = make_model(depth=4)
    ref_model = clone_model(model)
    opt = _flat(model, ctx, torch.optim.SGD, lr=0.1)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    totals = []
    for step in range(3):
        for m in (model, ref_model):
            m.zero_grad()
            backward(m, step)
        for p in list(model.parameters()) + list(ref_model.parameters()):
            p.grad.mul_(50)
        fn = (lambda ps: ps) if filtered else None
        mine = opt.clip_grad_norm(0.5, norm_type, filter_params_fn=fn)
        theirs = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, norm_type)
        totals.append((float(mine), float(theirs)))
        opt.step()
        ref.step()
    diff = (flat_params(model) - flat_params(ref_model)).abs().max().item()
    return {"totals": totals, "diff": diff, "params": flat_params(model)}


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("norm_type,filtered", [(2.0, False), (float("inf"), False), (1.0, True)])
def test_clip_grad_norm_over_pieces_matches_torch(pool, world, norm_type, filtered):
    results = pool.run(clip_task, norm_type, filtered, **world)
    for r in results:
        for mine, theirs in r["totals"]:
            assert theirs > 0.5  # clipping happened
            assert mine == pytest.approx(theirs, rel=2e-6)  # float32 rounding
        assert r["diff"] < 1e-6
        assert torch.equal(r["params"], results[0]["params"])


def wire_task(ctx, cut=False):
    """One bf16-compressed step: every element, the owner's pieces too, is plain Adam's value
    rounded (the owner keeps the exact one in its main copy)."""
    model = make_cut_model() if cut else make_model(depth=4)
    ref_model = clone_model(model)
    opt = _flat(model, ctx, torch.optim.Adam, broadcast_dtype=torch.bfloat16, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    train_in_lockstep(model, opt, ref_model, ref, 1)
    got, want = flat_params(model), flat_params(ref_model)
    rounded = want.to(torch.bfloat16).float()
    return {
        "rounded": torch.equal(got, rounded),
        "changed": not torch.equal(rounded, want),
        "main_bytes": opt.sync.main_bytes(),
        "got": got,
    }


@pytest.mark.parametrize("cut", [False, True], ids=["back_to_back", "slotted"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3]], ids=["ws2", "ws4"])
def test_compressed_wire_rounds_every_replica_alike(pool, world, cut):
    results = pool.run(wire_task, cut, **world)
    for r in results:
        assert r["rounded"] and r["changed"] and r["main_bytes"] > 0
        assert torch.equal(r["got"], results[0]["got"])


def tiny_updates_task(ctx):
    """50 SGD steps of 1e-4 on params at 1.0 over a bf16 wire (resolution 2**-7 there),
    params cut by range boundaries among them: the exact values accumulate on the owners."""
    sizes = [36, 6] * 29
    params = [torch.nn.Parameter(torch.ones(n)) for n in sizes]
    opt = OSS(params, optim=torch.optim.SGD, group=ctx.group, partition_rule="flat", lr=1e-4,
              broadcast_dtype=torch.bfloat16)  # fmt: skip
    want = torch.ones(sum(sizes))
    for _ in range(50):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        want.add_(torch.ones_like(want), alpha=-1e-4)  # plain SGD in fp32
    got = torch.cat([p.detach().reshape(-1) for p in params])
    slotted = opt.sync.status.vector is None
    return len(opt.plan.split), slotted, torch.equal(got, want.to(torch.bfloat16).float()), got


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[2]], ids=["ws2", "ws3"])
def test_updates_below_the_wire_resolution_accumulate_in_cut_params(pool, world):
    results = pool.run(tiny_updates_task, **world)
    for split, slotted, rounded, got in results:
        assert split >= 1 and slotted and rounded and bool((got < 1).all())
        assert torch.equal(got, results[0][3])


def written_in_place_task(ctx, cut):
    """Params written in place between steps (a model's ``load_state_dict``, an in-place op),
    params cut across ranks among them: the owners step the written values, as the plain
    optimizer does (``cut``: a model whose ranges carry slots, its cut params a copy)."""
    model = make_cut_model() if cut else make_model(depth=4)
    ref_model = clone_model(model)
    opt = _flat(model, ctx, torch.optim.Adam, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    exact = []
    for step in range(4):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward(m, step)
            o.step()
            if step == 0:
                m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
            elif step == 1:
                with torch.no_grad():
                    for p in m.parameters():
                        p.add_(0.25)
        exact.append(torch.equal(flat_params(model), flat_params(ref_model)))
    slotted = opt.sync.status.vector is None  # every code travels in a range's slot
    return {"exact": exact, "split": len(opt.plan.split), "slotted": slotted}


@pytest.mark.parametrize("cut", [True, False], ids=["slotted", "back_to_back"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
def test_params_written_in_place_between_steps_are_what_the_owners_step(pool, world, cut):
    for r in pool.run(written_in_place_task, cut, **world):
        assert r["split"] >= 1 and r["slotted"] == cut and all(r["exact"]), r


def scaler_task(ctx):
    """ShardedGradScaler with the flat rule against torch's GradScaler and optimizer."""
    model = make_model(depth=4)
    ref_model = clone_model(model)
    opt = _flat(model, ctx, torch.optim.Adam, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    scaler = oss_plus.ShardedGradScaler("cpu", init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    exact = []
    for step in range(4):
        for m, o, s in ((model, opt, scaler), (ref_model, ref, ref_scaler)):
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            if step == 2:  # an overflow: every rank skips the step
                next(m.parameters()).grad.view(-1)[0] = float("inf")
            s.step(o)
            s.update()
        exact.append(torch.equal(flat_params(model), flat_params(ref_model)))
    return {"exact": exact, "scale": scaler.get_scale(), "ref_scale": ref_scaler.get_scale()}


@pytest.mark.parametrize("world", [WORLDS[0], WORLDS[1], WORLDS[4]], ids=["ws1", "ws2", "offset23"])
def test_sharded_grad_scaler(pool, world):
    for r in pool.run(scaler_task, **world):
        assert all(r["exact"]) and r["scale"] == r["ref_scale"] < 2.0**10


class Lamb(torch.optim.Adam):
    """A stand-in for a non-elementwise update (a per-tensor trust ratio)."""


def refuse_task(ctx, declare):
    if declare:
        oss_plus.elementwise(Lamb)
    model = make_model()
    try:
        OSS(model.parameters(), optim=Lamb, group=ctx.group, partition_rule="flat", lr=0.1)
    except ValueError as exc:
        return str(exc)
    finally:
        oss_plus.step.pieces.ELEMENTWISE.discard(Lamb)
    return "accepted"


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_a_non_elementwise_optimizer_is_refused_on_every_rank(pool, world):
    for message in pool.run(refuse_task, False, **world):
        assert "Lamb is not known to be" in message and "oss_plus.elementwise(Lamb)" in message
    assert pool.run(refuse_task, True, **world) == ["accepted"] * 2


def test_flat_needs_the_owner_buckets_layout():
    from oss_plus.planning.policy import ShardPolicy
    from oss_plus.step.params import check_options

    with pytest.raises(ValueError, match="owner_buckets"):
        check_options(torch.optim.SGD, None, ShardPolicy("flat", layout="per_param"), None)
    assert check_options(torch.optim.SGD, None, None, "flat").rule.value == "flat"


def overlap_task(ctx):
    from helpers import ddp_of, make_overlap_model

    from oss_plus.overlap import overlap_with_ddp

    model = make_overlap_model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1,
              partition_rule="flat")  # fmt: skip
    try:
        overlap_with_ddp(ddp_of(ctx, model), opt)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_the_ddp_overlap_refuses_the_flat_rule_on_every_rank(pool):
    for message in pool.run(overlap_task, world_size=2):
        assert "partition_rule='flat'" in message and "does not take" in message


def realloc_task(ctx, kind):
    """Params re-allocated between steps (``.data`` replaced, or a dtype change that moves the
    cut): the next step re-points the pieces (and cuts again), exactly as the reference."""
    model = make_model(depth=4)
    ref_model = clone_model(model)
    optim, kwargs = (torch.optim.SGD, {"lr": 0.1}) if kind == "double" else (
        torch.optim.Adam, {"lr": 0.01})  # fmt: skip
    opt = _flat(model, ctx, optim, **kwargs)
    ref = optim(ref_model.parameters(), **kwargs)
    exact = train_in_lockstep(model, opt, ref_model, ref, 2)
    before = opt.plan.pieces
    for m in (model, ref_model):
        if kind == "double":
            m.double()
        else:
            for p in m.parameters():
                p.data = p.data.clone()
    dtype = next(model.parameters()).dtype
    for step in range(2):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(batch(step).to(dtype)).pow(2).mean().backward()
            o.step()
        exact.append(torch.equal(flat_params(model), flat_params(ref_model)))
    return {"exact": exact, "recut": opt.plan.pieces != before}


@pytest.mark.parametrize("kind", ["clone", "double"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_reallocated_params_are_followed(pool, world, kind):
    for r in pool.run(realloc_task, kind, **world):
        assert all(r["exact"]), r["exact"]
        assert r["recut"] == (kind == "double")


def diverged_task(ctx, rule):
    """requires_grad changed on rank 0 only, then refresh_trainable() on every rank: the
    ranks plan differently, and the repartition raises on every rank before any state moves
    (it used to exchange state by mismatched plans). At a step with auto_refresh the ranks
    would not even agree to repartition: that stays the user's contract (freeze everywhere).
    """
    from helpers import catch

    model = make_model(depth=4)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01,
              partition_rule=rule, auto_refresh=False)  # fmt: skip
    train_in_lockstep(model, opt, clone_model(model), torch.optim.Adam(
        clone_model(model).parameters(), lr=0.01), 1)  # fmt: skip
    if ctx.rank == 0:
        model[0].weight.requires_grad_(False)
    return catch(opt.refresh_trainable)


@pytest.mark.parametrize("rule", ["flat", "fairscale"])
def test_plans_that_differ_between_ranks_raise_on_every_rank(pool, rule):
    for status, message in pool.run(diverged_task, rule, world_size=2):
        assert status == "ValueError", (status, message)
        assert (
            "the ranks hold different shard plans (global ranks with equal plans: [[0], [1]])"
            in message
        )
