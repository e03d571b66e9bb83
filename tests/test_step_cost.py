"""What one ``OSS.step`` costs the host beyond the inner optimizer (issue 19).

* device-to-host reads: none at any world size (the peers' status travels with the buckets
  and is read from host memory at the next check, issue 27), counted where torch turns a
  tensor into a Python value;
* allocations: no wire buffer at world size 1, measured in bytes by torch's allocator
  profiler against the plain optimizer's step;
* the automatic trainability / re-allocation checks: on by default, off with
  ``auto_refresh=False`` (then an explicit ``refresh_trainable()`` / ``install_sync()`` is
  the user's job).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import WORLD_IDS, WORLDS, backward, catch, make_model, params_equal, train
from torch.profiler import ProfilerActivity, profile

from oss_plus import OSS
from oss_plus.bench.measure import host_reads
from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.planning.policy import ShardPolicy
from oss_plus.step.params import BAD_AUTO_REFRESH
from oss_plus.wire.changes import WINDOWS
from oss_plus.wire.sync import any_set


def test_the_counter_sees_reads_and_any_set_reads_once():
    t = torch.ones(3)
    with host_reads() as seen:
        t.sum().item()
        bool(t[0])
        t.tolist()
        float(t[1])
    assert seen == ["item", "__bool__", "tolist", "__float__"]
    slots = [torch.zeros(1), torch.zeros(1), torch.ones(1)]
    with host_reads() as seen:
        flags = (any_set(slots), any_set(slots[:2]), any_set(slots[:1]), any_set([]))
    assert flags == (True, False, False, False)
    assert len(seen) == 3  # one per call with slots, none without


# ------------------------------------------------------------------ host reads per step
def reads_task(ctx, kind: str) -> tuple[list[int], list[int], bool]:
    """Reads during each of 3 steps of OSS (``kind``) and of plain SGD; parity with it."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    if kind == "torch_per_param":  # a layout without status slots: a status all_gather
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=ctx.group, **kwargs
        )
    else:
        opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, **kwargs)
    ref = torch.optim.SGD(ref_model.parameters(), **kwargs)
    counts: dict[str, list[int]] = {"ours": [], "plain": []}
    for step in range(3):
        for key, m, o in (("ours", model, opt), ("plain", ref_model, ref)):
            o.zero_grad()
            backward(m, step)
            with host_reads() as seen:
                o.step()
            counts[key].append(len(seen))
    return counts["ours"], counts["plain"], params_equal(model, ref_model)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("kind", ["core", "torch_per_param"])
def test_a_step_reads_nothing_from_the_device(pool, world, kind):
    for ours, plain, same in pool.run(reads_task, kind, **world, timeout=60):
        assert same, "the steps differ from plain SGD"
        assert plain == [0, 0, 0]  # the counter sees only what the wrapper adds
        assert ours == [0, 0, 0], ours


# ------------------------------------------------------------------ no wire buffer alone
def allocated_bytes(fn) -> int:
    """Bytes torch's CPU allocator handed out while ``fn`` ran (frees not subtracted)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def wire_alone_task(ctx) -> dict[str, int]:
    """Bytes allocated by construction + 3 steps, at world size 1, fp32 and bf16 wire, and
    by plain SGD's 3 steps; and what a bf16 wire buffer of the model would weigh."""
    width = 256  # ~0.2M params: a wire buffer would be ~400 KB
    out = {}
    for wire in (None, torch.bfloat16, "plain"):
        model = make_model(width=width)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)

        def run(model=model, wire=wire):
            if wire == "plain":
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            else:
                opt = OSS(model.parameters(), group=ctx.group, lr=0.1, broadcast_dtype=wire)
            for _ in range(3):
                opt.step()

        run()  # warm up whatever torch caches on a first call
        out[str(wire)] = allocated_bytes(run)
    out["wire_buffer"] = sum(p.numel() for p in make_model(width=width).parameters()) * 2
    return out


def test_no_wire_buffer_and_no_bucket_when_nothing_travels(pool):
    (r,) = pool.run(wire_alone_task, world_size=1, timeout=60)
    assert r["wire_buffer"] > 100_000
    # OSS's construction + steps allocate no more than plain SGD's steps plus a small
    # constant (its bookkeeping): far less than one compressed copy of the model
    assert r["torch.bfloat16"] - r["plain"] < r["wire_buffer"] // 10, r
    assert r["torch.bfloat16"] == r["None"], r  # the wire dtype changes nothing alone


# ------------------------------------------------------------------ auto_refresh
def freeze_task(ctx, auto: bool) -> dict:
    """Freeze a param between steps: the plan's trainability after WINDOWS more steps
    (detected: a freeze only unbalances the plan, so the trainable params are read a slice
    per step), then after an explicit refresh_trainable(); unfreeze it: the plan at the next
    step (an unfrozen param must travel at once); parity with plain SGD throughout and after
    a re-allocation that the user declares with install_sync() when auto is off."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, auto_refresh=auto)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    train(model, opt, 1)
    train(ref_model, ref, 1)
    for m in (model, ref_model):
        m[0].weight.requires_grad_(False)
    train(model, opt, 1, start=1)
    train(ref_model, ref, 1, start=1)
    next_step = opt.plan.trainable
    train(model, opt, WINDOWS, start=2)
    train(ref_model, ref, WINDOWS, start=2)
    within = opt.plan.trainable
    opt.refresh_trainable()
    refreshed = opt.plan.trainable
    for m in (model, ref_model):
        m[0].weight.requires_grad_(True)
    unfrozen = opt.plan.trainable
    if not auto:
        opt.refresh_trainable()  # the user's job without auto_refresh
    start = 2 + WINDOWS
    train(model, opt, 1, start=start)
    train(ref_model, ref, 1, start=start)
    if auto:
        unfrozen = opt.plan.trainable
    for p in model.parameters():  # what module.to(...) does
        p.data = p.data.clone()
    if not auto:
        opt.install_sync()
    train(model, opt, 2, start=start + 1)
    train(ref_model, ref, 2, start=start + 1)
    same, intact = params_equal(model, ref_model), opt.sync.is_intact()
    return {"next": next_step, "within": within, "refreshed": refreshed, "unfrozen": unfrozen,
            "same": same, "intact": intact}  # fmt: skip


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "manual"])
def test_auto_refresh_detects_changes_at_step_and_can_be_turned_off(pool, auto):
    for r in pool.run(freeze_task, auto, world_size=2):
        everything = (True,) * len(r["refreshed"])
        assert r["refreshed"][0] is False and all(r["refreshed"][1:])
        assert r["next"] == everything  # a freeze is not read at once...
        assert r["within"] == (r["refreshed"] if auto else everything)  # ...but within WINDOWS
        assert r["unfrozen"] == (everything if auto else r["refreshed"])  # an unfreeze at once
        assert r["same"] and r["intact"]


def bad_auto_refresh_task(ctx):
    value = "yes" if ctx.rank == 1 else True  # one rank's bad value raises on every rank
    return catch(OSS, make_model().parameters(), group=ctx.group, lr=0.1, auto_refresh=value)


def test_auto_refresh_is_validated_on_every_rank(pool):
    mine, theirs = pool.run(bad_auto_refresh_task, world_size=2)[::-1]
    assert mine == ("TypeError", BAD_AUTO_REFRESH.format(value="yes"))
    assert theirs[0] == "TypeError" and "rank 1" in theirs[1]


def test_single_rank_layout_is_a_validated_policy_flag():
    assert ShardPolicy().single_rank_layout is False
    with pytest.raises(TypeError, match="single_rank_layout must be a bool"):
        ShardPolicy(single_rank_layout=1)  # type: ignore[arg-type]
