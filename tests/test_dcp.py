"""``OSS`` in torch's ``torch.distributed.checkpoint`` flow (issue 37, item 1).

``get_state_dict`` -> ``dcp.save`` -> a fresh model and optimizer -> ``dcp.load`` ->
``set_state_dict``, compared with the unsharded torch optimizer trained without interruption
(and with DDP + the plain optimizer / FSDP2 loading the same checkpoint), tensor by tensor.
"""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import catch, ddp_of, flat_params, make_cut_model, train
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from oss_plus import OSS, ShardedDataParallel
from oss_plus.compat import fairscale
from oss_plus.compat import torch as torch_compat
from oss_plus.runtime import arrival as _arrival
from oss_plus.state.sharded_tensor import range_blocks

RULES = ["fairscale", "torch", "flat"]
SAVED, MORE = 3, 2


def model_for(rule, seed=0):
    """One model for every rule (a checkpoint moves between rules); the flat rule cuts some
    of its params across ranks at 2 and 3 ranks."""
    return make_cut_model(seed)


def build(kind, ctx, rule="fairscale", seed=0, lr=0.01, **extra):
    """A model and its optimizer: OSS (and its adapters) or DDP / FSDP2 + the plain AdamW."""
    model = model_for(rule, seed)
    if kind == "ddp":
        model = ddp_of(ctx, model)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(ctx.group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = model.parameters()
    if kind == "sdp":  # OSS + oss_plus's ZeRO-2 wrapper
        opt = OSS(params, torch.optim.AdamW, group=ctx.group, lr=lr, partition_rule=rule)
        return ShardedDataParallel(model, opt, ctx.group), opt
    if kind in ("ddp", "fsdp2"):
        return model, torch.optim.AdamW(params, lr=lr)
    if kind == "fairscale":
        return model, fairscale.OSS(params, torch.optim.AdamW, group=ctx.group, lr=lr, **extra)
    if kind == "torch":
        zero = torch_compat.ZeroRedundancyOptimizer
        return model, zero(params, torch.optim.AdamW, process_group=ctx.group, lr=lr, **extra)
    return model, OSS(
        params, torch.optim.AdamW, group=ctx.group, lr=lr, partition_rule=rule, **extra
    )


def values(model):
    """Every param's values, in order (FSDP2's gathered)."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in full])


def reference(rule, steps):
    """The unsharded AdamW after ``steps`` uninterrupted steps: params and state by FQN."""
    model = model_for(rule)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, steps)
    names = [n for n, _ in model.named_parameters()]
    state = {names[i]: s for i, s in opt.state_dict()["state"].items()}
    return flat_params(model), state


def whole_state(model, opt):
    """The whole state by FQN, gathered with torch's own full_state_dict (every rank)."""
    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, opt, options=options)["state"]
    return copy.deepcopy(state)  # live tensors, as torch gives them for a plain optimizer


def assert_state(got, want):
    assert sorted(got) == sorted(want)
    for name, state in want.items():
        assert sorted(got[name]) == sorted(state), name
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got[name][key]), value), (name, key)


# ------------------------------------------------------------------ save, then load
def named(model):
    """The module whose names are the FQNs: ShardedDataParallel's wrapped module (torch
    strips DDP's ``module.`` prefix itself, not other wrappers')."""
    return model.module if isinstance(model, ShardedDataParallel) else model


def save_task(ctx, kind, rule, path, extra):
    options = StateDictOptions(**extra.pop("options", {}))
    model, opt = build(kind, ctx, rule, **extra)
    train(model, opt, SAVED)
    model_sd, optim_sd = get_state_dict(named(model), opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=ctx.group)
    split = bool(opt.plan.split) if hasattr(opt, "plan") else None
    train(model, opt, MORE, start=SAVED)  # torch's probes must not have touched the state
    return split, values(model)


def load_task(ctx, kind, rule, path, extra):
    # other values and another lr: everything must come from the checkpoint (the template's
    # tensors are the live state, so DCP loads them in place; the lr only set_state_dict)
    options = StateDictOptions(**extra.pop("options", {}))
    model, opt = build(kind, ctx, rule, seed=1, lr=0.5, **extra)
    model_sd, optim_sd = get_state_dict(named(model), opt, options=options)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=ctx.group)
    model, sds = named(model), {"model_state_dict": model_sd, "optim_state_dict": optim_sd}
    set_state_dict(model, opt, **sds, options=options)
    loaded = whole_state(named(model), opt)
    lr = opt.param_groups[0]["lr"]
    train(model, opt, MORE, start=SAVED)
    return loaded, lr, values(model)


def where(world):
    """``pool.run``'s keyword for a world size, or a tuple of global ranks."""
    return {"ranks": world} if isinstance(world, tuple) else {"world_size": world}


def check_resume(pool, tmp_path, save, load, extra=None):
    """Save with ``save = (kind, rule, world)``, load with ``load``; compare with the
    unsharded AdamW: the state at the save, the params after more steps."""
    path, extra = str(tmp_path / "ckpt"), extra or {}
    (saver, rule, world), (loader, load_rule, load_world) = save, load
    want_params, _ = reference(rule, SAVED + MORE)
    _, saved_state = reference(rule, SAVED)
    for split, params in pool.run(save_task, saver, rule, path, extra, **where(world)):
        assert torch.equal(params, want_params)  # the save changed nothing
        assert split in (None, rule == "flat")
    results = pool.run(load_task, loader, load_rule, path, extra, **where(load_world))
    for loaded, lr, params in results:
        assert_state(loaded, saved_state)
        assert lr == 0.01
        assert torch.equal(params, want_params)


@pytest.mark.parametrize("rule", RULES)
def test_resume_exactly_at_the_same_world_size(pool, tmp_path, rule):
    check_resume(pool, tmp_path, ("oss", rule, 2), ("oss", rule, 2))


@pytest.mark.parametrize(
    ("save", "load"),
    [
        (("oss", "flat", 3), ("oss", "flat", 2)),
        (("oss", "flat", 2), ("oss", "fairscale", 3)),
        (("oss", "fairscale", 3), ("oss", "flat", 2)),
        (("oss", "torch", 2), ("oss", "flat", 3)),
        (("oss", "flat", (2, 3)), ("oss", "flat", 3)),  # a group without global rank 0
    ],
)
def test_resume_at_another_world_size_and_rule(pool, tmp_path, save, load):
    check_resume(pool, tmp_path, save, load)


@pytest.mark.parametrize(
    ("save", "load"),
    [
        (("oss", "flat", 2), ("ddp", "flat", 2)),
        (("ddp", "flat", 2), ("oss", "flat", 3)),
        (("oss", "flat", 3), ("fsdp2", "flat", 2)),
        (("fsdp2", "fairscale", 2), ("oss", "torch", 3)),
        (("fairscale", "fairscale", 2), ("torch", "fairscale", 3)),
        (("torch", "fairscale", 3), ("ddp", "fairscale", 2)),
        (("sdp", "flat", 2), ("oss", "flat", 3)),
        (("oss", "torch", 3), ("sdp", "fairscale", 2)),
    ],
)
def test_interop_with_ddp_fsdp2_and_the_adapters(pool, tmp_path, save, load):
    # DDP, FSDP2 and ShardedDataParallel train at 2 ranks: their average of identical
    # gradients over 3 ranks is not exact, and the params are compared bit for bit
    check_resume(pool, tmp_path, save, load)


def test_collective_state_dict_takes_the_same_path(pool, tmp_path):
    """The setting of the measured wrong restore (step 2 instead of 1) now resumes exactly."""
    extra = {"collective_state_dict": True}
    check_resume(pool, tmp_path, ("oss", "fairscale", 2), ("oss", "fairscale", 2), extra)


def test_flattened_optimizer_state_dicts_resume_too(pool, tmp_path):
    """torchtitan's setting: the keys are flattened, and the load reads ``opt.state``."""
    extra = {"options": {"flatten_optimizer_state_dict": True}}
    check_resume(pool, tmp_path, ("oss", "flat", 2), ("oss", "flat", 3), extra)


# ------------------------------------------------------------------ what each rank holds
def held_task(ctx, rule):
    model, opt = build("oss", ctx, rule)
    train(model, opt, SAVED)
    state = get_optimizer_state_dict(model, opt)["state"]
    held = 0  # elements of per-element state this rank holds (a ShardedTensor: its shards)
    for entry in state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry.get(key)
            shards = value.local_shards() if hasattr(value, "local_shards") else None
            if shards is not None:
                held += sum(s.tensor.numel() for s in shards)
            elif value is not None:
                held += value.numel()
    return held, sorted(state)


@pytest.mark.parametrize("rule", RULES)
def test_each_element_is_held_once_nothing_is_gathered(pool, rule):
    _, want = reference(rule, SAVED)
    total = sum(s[k].numel() for s in want.values() for k in ("exp_avg", "exp_avg_sq"))
    results = pool.run(held_task, rule, world_size=3)
    assert sum(held for held, _ in results) == total
    assert all(0 < held < total for held, _ in results)
    assert all(names == sorted(want) for _, names in results)  # every FQN on every rank


def full_task(ctx, rule):
    model, opt = build("oss", ctx, rule)
    train(model, opt, SAVED)
    full_options = StateDictOptions(full_state_dict=True)
    full = copy.deepcopy(get_optimizer_state_dict(model, opt, options=full_options))
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    on_rank0 = copy.deepcopy(get_optimizer_state_dict(model, opt, options=offload))
    fresh, other = build("oss", ctx, "fairscale", seed=1)  # another rule loads it
    set_optimizer_state_dict(fresh, other, copy.deepcopy(full), options=full_options)
    return full["state"], on_rank0.get("state"), whole_state(fresh, other)


@pytest.mark.parametrize("rule", ["fairscale", "flat"])
def test_full_state_dict_and_cpu_offload(pool, rule):
    _, want = reference(rule, SAVED)
    for rank, (full, offloaded, reloaded) in enumerate(pool.run(full_task, rule, world_size=2)):
        assert_state(full, want)
        assert_state(reloaded, want)
        if rank == 0:
            assert_state(offloaded, want)
        else:
            assert offloaded is None  # torch keeps a cpu_offload full state on rank 0 only


# ------------------------------------------------------------------ some ranks only
def alone_task(ctx):
    model, opt = build("oss", ctx)  # under the default arrival timeout: a slow start is fine
    train(model, opt, 1)
    default, _arrival.ARRIVAL_TIMEOUT = _arrival.ARRIVAL_TIMEOUT, timedelta(seconds=1)
    try:
        alone = catch(get_state_dict, model, opt) if ctx.rank == 0 else None
        torch.distributed.barrier(group=ctx.group)
        together = get_optimizer_state_dict(model, opt)  # every rank: works again
        alone_set = catch(set_optimizer_state_dict, model, opt, together) if ctx.rank else None
        torch.distributed.barrier(group=ctx.group)
        return alone, sorted(together["state"]), alone_set
    finally:
        _arrival.ARRIVAL_TIMEOUT = default


def test_a_call_on_some_ranks_raises_instead_of_hanging(pool):
    results = pool.run(alone_task, world_size=2)
    for caller, other in ((0, 1), (1, 0)):  # rank 0 gets alone, then rank 1 sets alone
        what = 0 if caller == 0 else 2
        name, message = results[caller][what]
        assert name == "RuntimeError" and "not every one of the 2 ranks" in message
        assert results[other][what] is None
    assert results[0][1] == results[1][1] and len(results[0][1]) == 58


# ------------------------------------------------------------------ chunks of a piece
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (4, 1, 3)])
def test_range_blocks_cover_the_range_in_order(shape):
    numel = 1
    for s in shape:
        numel *= s
    ids = torch.arange(numel).view(shape)
    for start in range(numel):
        for end in range(start + 1, numel + 1):
            got = [
                ids[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
                for offsets, sizes in range_blocks(shape, start, end)
            ]
            assert torch.equal(torch.cat(got), torch.arange(start, end)), (start, end)


def test_range_blocks_keeps_its_public_path_in_dcp():
    from oss_plus.state import dcp

    assert dcp.range_blocks is range_blocks and "range_blocks" in dcp.__all__


# ------------------------------------------------------------------ a rank without state
def stateless_rank_task(ctx, path):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)  # 2 params on 3 ranks: one rank owns nothing
    opt = OSS(model.parameters(), torch.optim.AdamW, group=ctx.group, lr=0.01)
    train(model, opt, SAVED)
    held = len(opt.state)
    opt.zero_grad()  # no grads: torch's probe looks at the state alone
    model_sd, optim_sd = get_state_dict(model, opt)  # no rank may run torch's probe step
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=ctx.group)
    train(model, opt, MORE, start=SAVED)
    return held, values(model)


def test_a_rank_that_owns_nothing_does_not_run_torchs_probe(pool, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    train(model, torch.optim.AdamW(model.parameters(), lr=0.01), SAVED + MORE)
    results = pool.run(stateless_rank_task, str(tmp_path / "ckpt"), world_size=3)
    assert sorted(held for held, _ in results) == [0, 1, 1]
    assert all(torch.equal(params, values(model)) for _, params in results)


def wrong_shape_task(ctx):
    model, opt = build("oss", ctx)
    train(model, opt, 1)
    whole = copy.deepcopy(get_optimizer_state_dict(model, opt, options=StateDictOptions(True)))
    whole["state"]["0.weight"]["exp_avg"] = torch.zeros(3)  # the param is 6 x 6
    return catch(set_optimizer_state_dict, model, opt, whole)


def test_a_state_that_does_not_fit_raises_on_every_rank(pool):
    for name, message in pool.run(wrong_shape_task, world_size=2):
        assert name == "ValueError" and "exp_avg" in message, message


def local_state_task(ctx):
    model, opt = build("oss", ctx, "flat")
    train(model, opt, 1)
    params = list(model.parameters())
    held = [i for i, p in enumerate(params) if p in opt.state]
    whole = [i for i in held if i not in opt.plan.split]
    values = {i: copy.deepcopy(opt.state[params[i]]) for i in held}
    others = [opt.state[p] for i, p in enumerate(params) if i not in held]
    changed = whole[0] if ctx.rank == 0 else None
    if changed is not None:  # Lightning's optimizer-to-device move assigns a param's state
        state = opt.state[params[changed]]
        opt.state[params[changed]] = {**state, "exp_avg": state["exp_avg"] + 1}
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return held, sorted(opt.plan.split), values, others, changed, copy.deepcopy(full["state"])


def test_state_is_this_ranks_share_by_param(pool):
    _, want = reference("flat", 1)
    names = [n for n, _ in make_cut_model().named_parameters()]
    results = pool.run(local_state_task, world_size=2)
    held = [set(r[0]) for r in results]
    split = set(results[0][1])
    assert split and held[0] & held[1] == split and held[0] | held[1] == set(range(len(names)))
    changed = results[0][4]
    for _, _, values, others, _, full in results:
        assert all(o == {} for o in others)
        for i, state in values.items():
            ref = want[names[i]]
            assert torch.equal(state["step"], ref["step"])
            if i not in split:  # a split param's state is this rank's piece (checked above)
                assert torch.equal(state["exp_avg"], ref["exp_avg"])
        assert torch.equal(full[names[changed]]["exp_avg"], want[names[changed]]["exp_avg"] + 1)
