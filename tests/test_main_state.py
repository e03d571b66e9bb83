"""The exact values of a compressed wire (the owners' main copies) travel with the optimizer's
state: checkpoints (both layouts, asynchronous), the consolidated state dict and every
repartition. Compared with an independent reference: the unsharded Adam stepping fp32 main
params, whose model holds them rounded to the wire (Megatron-Core's distributed optimizer,
unsharded), and with an uninterrupted run."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import backward, clone_model, make_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint import read_state_dict
from oss_plus.planning.partition import Rule
from oss_plus.planning.plan import make_plan
from oss_plus.step.params import param_specs
from oss_plus.wire.main.region import MAIN_KEY

WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LR = 1e-3
STEPS = 8  # before and after the save


def new_model():
    return make_model(depth=4)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


class Reference:
    """Adam on fp32 main params; the model holds them rounded to ``wire`` after every step."""

    def __init__(self, model, wire):
        self.model, self.wire = clone_model(model), wire
        self.main = [torch.nn.Parameter(p.detach().clone()) for p in self.model.parameters()]
        self.opt = torch.optim.Adam(self.main, lr=LR)
        self.active = len(self.main)  # the params an optimizer holds (the others stay exact)

    def step(self, step):
        self.model.zero_grad()
        backward(self.model, step)
        for m, p in zip(self.main, self.model.parameters()):
            m.grad = p.grad
        self.opt.step()
        with torch.no_grad():
            for p, m in list(zip(self.model.parameters(), self.main))[: self.active]:
                p.copy_(m if self.wire is None else m.to(self.wire))


def oss_for(model, ctx, wire, rule):
    return OSS(
        model.parameters(),
        optim=torch.optim.Adam,
        group=ctx.group,
        lr=LR,
        partition_rule=rule,
        broadcast_dtype=WIRES[wire],
    )


def train(model, opt, start, steps):
    for step in range(start, start + steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()


def save_task(ctx, root, wire, rule):
    """Train STEPS steps, save every form of the state, train STEPS more (uninterrupted)."""
    model = new_model()
    ref = Reference(model, WIRES[wire])
    opt = oss_for(model, ctx, wire, rule)
    for step in range(STEPS):
        ref.step(step)
    train(model, opt, 0, STEPS)
    save_checkpoint(opt, f"{root}/sharded")
    save_checkpoint(opt, f"{root}/consolidated", sharded=False)
    future = save_checkpoint(opt, f"{root}/async", blocking=False)
    model_sd, optim_sd = get_state_dict(model, opt)  # torch's DCP flow (oss_plus.state.dcp)
    dcp.save(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp", process_group=ctx.group
    )
    state_dict = copy.deepcopy(opt.state_dict(all_ranks=True))  # live tensors, as torch's
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    mains = [m.detach().clone() for m in ref.main]
    future.result()
    train(model, opt, STEPS, STEPS)
    for step in range(STEPS, 2 * STEPS):
        ref.step(step)
    return {
        "model": model_state,
        "state_dict": state_dict if ctx.rank == 0 else None,
        "mains": mains,
        "uninterrupted": params_of(model),
        "reference": params_of(ref.model),
    }


def resume_task(ctx, root, saved, wire, rule, form, wire_on=True):
    """A fresh model and optimizer: load the model's state dict and ``form`` of the state
    (the optimizer first for the checkpoints, last for the state dict), train STEPS steps."""
    model = new_model()
    opt = oss_for(model, ctx, wire, rule)
    if form == "state_dict":
        opt.load_state_dict(saved["state_dict"])
        model.load_state_dict(saved["model"])
    elif form == "dcp":
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{root}/dcp", process_group=ctx.group)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        model.load_state_dict(saved["model"])
        load_checkpoint(opt, f"{root}/{form}")
    if not wire_on:
        opt.broadcast_dtype = None
    train(model, opt, STEPS, 1 if not wire_on else STEPS)
    return params_of(model)


@pytest.fixture(
    scope="module", params=[(w, r) for w in sorted(WIRES) for r in ("fairscale", "flat")]
)
def saved(request, pool, tmp_path_factory):
    wire, rule = request.param
    root = tmp_path_factory.mktemp(f"main-{wire}-{rule}")
    results = pool.run(save_task, str(root), wire, rule, world_size=2)
    return wire, rule, root, results[0], results


def test_the_uninterrupted_run_is_the_reference(saved):
    *_, results = saved
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["uninterrupted"], r["reference"]))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("form", ["sharded", "consolidated", "async", "state_dict", "dcp"])
def test_a_resume_is_bit_identical_to_the_uninterrupted_run(pool, saved, world, form):
    wire, rule, root, first, _ = saved
    for params in pool.run(resume_task, str(root), first, wire, rule, form, world_size=world):
        for a, b in zip(params, first["uninterrupted"]):
            assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("form", ["sharded", "dcp"])
def test_saved_with_the_wire_on_loaded_with_it_off_every_replica_holds_the_exact_values(
    pool, saved, world, form
):
    """One step without the wire after the load: every replica holds the reference's exact
    main params after that step (the exact values came back on their owners)."""
    wire, rule, root, first, _ = saved
    model = new_model()
    ref = Reference(model, WIRES[wire])
    for step in range(STEPS):
        ref.step(step)
    ref.wire = None
    ref.step(STEPS)
    expected = [m.detach() for m in ref.main]
    for params in pool.run(
        resume_task, str(root), first, wire, rule, form, False, world_size=world
    ):
        for a, b in zip(params, expected):
            assert torch.equal(a, b), (a - b).abs().max()


def test_the_state_dict_and_checkpoints_hold_the_exact_values(saved):
    """``oss_plus.main`` of every param is the reference's fp32 main param at the save."""
    _, _, root, first, _ = saved
    for state in (first["state_dict"]["state"], read_state_dict(root / "sharded")["state"]):
        for i, main in enumerate(first["mains"]):
            assert torch.equal(state[i][MAIN_KEY], main), i


def test_a_plain_torch_optimizer_loads_the_state_dict_and_ignores_the_main_values(saved):
    """A plain Adam that loaded the state dict steps exactly as one that loaded it without
    the ``oss_plus.main`` entries."""
    _, _, _, first, _ = saved
    stripped = {
        "state": {
            i: {k: v for k, v in s.items() if k != MAIN_KEY}
            for i, s in first["state_dict"]["state"].items()
        },
        "param_groups": first["state_dict"]["param_groups"],
    }
    results = []
    for state_dict in (first["state_dict"], stripped):
        model = new_model()
        model.load_state_dict(first["model"])
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        opt.load_state_dict(copy.deepcopy(state_dict))  # torch aliases what it loads
        for step in range(STEPS, STEPS + 3):
            opt.zero_grad()
            backward(model, step)
            opt.step()
        results.append(params_of(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ------------------------------------------------------------------ repartitions
def repartition_task(ctx, wire, rule, how):
    """Train with the wire, repartition (``how``) midway, train on: every rank against the
    reference after every step."""
    model = new_model()
    params = list(model.parameters())
    ref = Reference(model, WIRES[wire])
    late = how == "add_param_group"
    opt = OSS(
        params[:-2] if late else params,
        optim=torch.optim.Adam,
        group=ctx.group,
        lr=LR,
        partition_rule=rule,
        broadcast_dtype=WIRES[wire],
    )
    if late:
        ref.opt, ref.active = torch.optim.Adam(ref.main[:-2], lr=LR), len(ref.main) - 2
    exact = []
    for step in range(2 * STEPS):
        if step == STEPS:
            if how == "add_param_group":
                opt.add_param_group({"params": params[-2:]})
                ref.opt.add_param_group({"params": ref.main[-2:]})
                ref.active = len(ref.main)
            elif how == "refresh_trainable":
                opt.refresh_trainable()
            elif how == "install_sync":
                opt.install_sync()
            else:  # owners move: the torch rule's plan
                policy = dataclasses.replace(opt.policy, rule=Rule.TORCH)
                specs = param_specs(opt.param_groups, policy.aligned)
                plan = make_plan(specs, opt.world_size, policy)
                assert plan.owners != opt.plan.owners
                opt.repartition(plan)
        train(model, opt, step, 1)
        ref.step(step)
        exact.append(all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(ref.model))))
    return exact


HOWS = {
    "fairscale": ("repartition", "refresh_trainable", "install_sync", "add_param_group"),
    "flat": ("refresh_trainable", "install_sync", "add_param_group"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("rule,how", [(r, h) for r, hows in HOWS.items() for h in hows])
def test_a_repartition_keeps_the_exact_values(pool, world, wire, rule, how):
    for exact in pool.run(repartition_task, wire, rule, how, world_size=world):
        assert exact == [True] * len(exact)


# ------------------------------------------------------------------ older checkpoints
def fixture_task(ctx, layout):
    """The format-v1 fixture (no main values) into an OSS with a bf16 wire: it loads, the
    first step rounds every replica, and the exact values of that step are the plain Adam's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import json

    import checkpoint_v1 as fixture

    from oss_plus.checkpoint.values import decode_value

    expected = decode_value(json.loads((fixture.HERE / "expected.json").read_text()), "expected")
    params = fixture.make_params()
    opt = OSS(fixture.groups_of(params), optim=torch.optim.Adam, group=ctx.group, lr=0.5)
    opt.broadcast_dtype = torch.bfloat16
    load_checkpoint(opt, fixture.HERE / layout)
    none_loaded = all(MAIN_KEY not in s for s in opt.state_dict(all_ranks=True)["state"].values())
    ref_params = fixture.make_params()
    ref = torch.optim.Adam(fixture.groups_of(ref_params), lr=0.5)
    ref.load_state_dict(expected)
    for p, q in zip(params, ref_params):
        if p.requires_grad:
            p.grad = q.grad = torch.full_like(p, 0.25)
    opt.step()
    ref.step()
    rounded = all(
        torch.equal(p, q.to(torch.bfloat16).to(q.dtype) if q.requires_grad else q)
        for p, q in zip(params, ref_params)
    )
    state = opt.state_dict(all_ranks=True)["state"]
    exact = all(
        torch.equal(state[i][MAIN_KEY], q)
        for i, q in enumerate(ref_params)
        if MAIN_KEY in state.get(i, {})
    )
    mains = sum(MAIN_KEY in s for s in state.values())
    return none_loaded, rounded, exact, mains


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_an_older_checkpoint_without_main_values_loads_with_a_compressed_wire(pool, layout, world):
    for none_loaded, rounded, exact, mains in pool.run(fixture_task, layout, world_size=world):
        assert none_loaded and exact
        assert rounded == (world > 1)  # at world size 1 nothing travels, nothing is rounded
        assert (mains > 0) == (world > 1)  # fp32/fp64 params went compressed


def world_one_task(ctx, root, saved, wire, rule):
    """At world size 1 (no wire, no replica) the loaded exact values go into the params."""
    model = new_model()
    opt = oss_for(model, ctx, wire, rule)
    model.load_state_dict(saved["model"])
    load_checkpoint(opt, f"{root}/sharded")
    return params_of(model)


def test_at_world_size_1_the_params_take_the_exact_values(pool, saved):
    wire, rule, root, first, _ = saved
    for params in pool.run(world_one_task, str(root), first, wire, rule, world_size=1):
        assert all(torch.equal(a, b) for a, b in zip(params, first["mains"]))


def bad_main_task(ctx, saved, wire, rule):
    model = new_model()
    opt = oss_for(model, ctx, wire, rule)
    state_dict = copy.deepcopy(saved["state_dict"])
    state_dict["state"][0][MAIN_KEY] = torch.zeros(3)
    try:
        opt.load_state_dict(state_dict)
    except ValueError as exc:
        return str(exc), opt.state_dict(all_ranks=True)["state"]
    return None, None


def test_main_values_of_another_shape_raise_before_anything_loads(pool, saved):
    wire, rule, _, first, _ = saved
    for message, state in pool.run(bad_main_task, first, wire, rule, world_size=2):
        assert message is not None and "'oss_plus.main'" in message and "(3,)" in message
        assert state == {}  # nothing was loaded


def uncompressed_dcp_task(ctx, root):
    """A DCP checkpoint of OSS without a wire (no main values), loaded into OSS with one:
    DCP's default planner refuses the keys the checkpoint lacks, on every rank; with
    ``allow_partial_load=True`` (or the wire turned on after the load) it loads."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    model = new_model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=LR)
    train(model, opt, 0, 2)
    model_sd, optim_sd = get_state_dict(model, opt)
    path = f"{root}/plain-dcp"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=ctx.group)
    saved = params_of(model)
    results = []
    for planner in (None, DefaultLoadPlanner(allow_partial_load=True)):
        fresh = new_model()
        wired = oss_for(fresh, ctx, "bf16", "fairscale")
        fresh_sd, fresh_optim = get_state_dict(fresh, wired)
        state = {"model": fresh_sd, "optim": fresh_optim}
        try:  # DCP raises CheckpointException, a BaseException
            dcp.load(state, checkpoint_id=path, process_group=ctx.group, planner=planner)
            results.append(("ok", ""))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results.append((type(exc).__name__, str(exc)))
    set_state_dict(fresh, wired, model_state_dict=fresh_sd, optim_state_dict=fresh_optim)
    return results, all(torch.equal(a, b) for a, b in zip(params_of(fresh), saved))


def test_a_checkpoint_without_main_values_needs_a_partial_load_under_a_wire(pool, tmp_path):
    for (strict, partial), params_loaded in pool.run(
        uncompressed_dcp_task, str(tmp_path), world_size=2
    ):
        assert strict[0] != "ok" and MAIN_KEY in str(strict[1]), strict
        assert partial[0] == "ok", partial
        assert params_loaded
