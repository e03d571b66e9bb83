"""oss_plus.overlap: the sharded step of oss_plus.OSS inside DDP's backward (comm hook).

The plan (pure) first, then multi-process checks against DDP + the unsharded optimizer.
The torch adapter's hooks are compared in compat/test_overlap_diff.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import (
    BUCKET_CAP_MB,
    MULTI_RANK_WORLD_IDS,
    MULTI_RANK_WORLDS,
    OVERLAP_OPTIMIZERS,
    catch,
    ddp_of,
    flat_params,
    logged,
    make_overlap_model,
    overlap_loss,
    params_equal,
)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import oss_plus
from oss_plus import OSS
from oss_plus.overlap import (
    GROUP_MISMATCH,
    PARAM_NOT_IN_DDP,
    PARAM_NOT_IN_OPTIMIZER,
    PARAMS_CHANGED,
    check_pairing,
    ddp_reduce_hook,
    overlap_hook,
    overlap_with_ddp,
)
from oss_plus.overlap.layout import STEP_WHILE_OVERLAPPED, OverlapSync
from oss_plus.overlap.plan import Assignment, local_order, owner_pieces, torch_assignments


# ------------------------------------------------------------------ the plan (pure)
def test_torch_assignments_whole_buckets_round_robin():
    got = torch_assignments([[4], [2, 2], [1], [3]], 3, shard_buckets=False)
    assert got == [
        Assignment(0, 0, 0, 1),
        Assignment(1, 1, 0, 2),
        Assignment(2, 2, 0, 1),
        Assignment(3, 0, 0, 1),
    ]


def test_torch_assignments_shard_buckets_cut_below_the_threshold():
    # total 24, 2 ranks: threshold 12. Buckets visited by size: 2 (4), 0 (8), 1 (12).
    got = torch_assignments([[3, 5], [4, 4, 4], [4]], 2, shard_buckets=True)
    assert got == [
        Assignment(2, 0, 0, 1),  # rank 0: 4
        Assignment(0, 1, 0, 2),  # rank 1: 8
        Assignment(1, 0, 0, 2),  # 4 + 4 + 4 >= 12: cut before the third param; rank 0: 12
        Assignment(1, 1, 2, 3),  # the rest to the least loaded rank not holding bucket 1 yet
    ]


def test_torch_assignments_more_slices_than_ranks_fall_back_instead_of_failing():
    # threshold 5 on 2 ranks: bucket [4, 2, 4] is cut in 3 slices; torch would raise
    # AssertionError("All indices are disallowed"); here the least loaded rank takes two.
    got = torch_assignments([[4, 2, 4]], 2, shard_buckets=True)
    assert [(a.start, a.stop) for a in got] == [(0, 1), (1, 2), (2, 3)]
    assert [a.owner for a in got] == [0, 1, 1]


def test_torch_assignments_reject_bad_input():
    with pytest.raises(ValueError, match="bucket 1 has no params"):
        torch_assignments([[1], []], 2, False)
    with pytest.raises(ValueError, match="world_size"):
        torch_assignments([[1]], 0, False)
    with pytest.raises(ValueError, match="start < stop"):
        Assignment(0, 0, 2, 2)


def test_owner_pieces_and_local_order():
    assert owner_pieces([1, 0, 1, None, 0]) == [(0, [1, 4]), (1, [0, 2])]
    assert owner_pieces([None]) == []
    plan = [Assignment(1, 0, 0, 2), Assignment(0, 1, 0, 1), Assignment(0, 0, 1, 3)]
    assert local_order(plan, 0) == [(1, 0), (1, 1), (0, 1), (0, 2)]
    assert local_order(plan, 1) == [(0, 0)]


# ------------------------------------------------------------------ helpers of the pool tasks
def groups_of(module: torch.nn.Module, lr: float) -> list[dict[str, Any]]:
    """Two param groups (every other param) with different learning rates."""
    params = list(module.parameters())
    return [{"params": params[::2]}, {"params": params[1::2], "lr": lr / 3}]


def build(
    ctx,
    model,
    opt_name,
    *,
    overlap=None,
    static=False,
    gabv=False,
    hook=None,
    **oss_kw,
):
    """DDP + optimizer: ``overlap`` None: the unsharded torch optimizer (the reference),
    else OSS with the overlapped step (``overlap`` = interleaved or not)."""
    cls, kwargs = OVERLAP_OPTIMIZERS[opt_name]
    ddp = ddp_of(ctx, model, static, gabv)
    groups = groups_of(ddp.module, kwargs["lr"])
    if overlap is None:
        if hook is not None:
            ddp.register_comm_hook(ctx.group, hook)
        return ddp, cls(groups, **kwargs)
    opt = OSS(groups, optim=cls, group=ctx.group, **oss_kw, **kwargs)
    if hook is None:
        overlap_with_ddp(ddp, opt, interleaved=overlap)
    else:
        ddp.register_comm_hook(None, overlap_hook(hook, ddp, opt, interleaved=overlap))
    return ddp, opt


def train_both(ctx, pair, ref, iters, decay_lr=False):
    """Train both (no step() for the overlapped one); equality after each iteration."""
    ddp, opt = pair
    ref_ddp, ref_opt = ref
    same = []
    for it in iters:
        for d, o in ((ref_ddp, ref_opt), (ddp, opt)):
            o.zero_grad()
            overlap_loss(d, it, ctx.rank).backward()
        ref_opt.step()
        if decay_lr:  # what an LR scheduler does, on both
            for o in (opt, ref_opt):
                for g in o.param_groups:
                    g["lr"] *= 0.7
        same.append(params_equal(ddp, ref_ddp))
    return same


# ------------------------------------------------------------------ parity
def parity_task(ctx, opt_name, configs, iters):
    out = []
    for interleaved, static, gabv in configs:
        model = make_overlap_model()
        pair = build(
            ctx,
            copy.deepcopy(model),
            opt_name,
            overlap=interleaved,
            static=static,
            gabv=gabv,
        )
        ref = build(ctx, copy.deepcopy(model), opt_name, static=static)
        same = train_both(ctx, pair, ref, range(iters), decay_lr=True)
        layout = pair[1].sync
        overlapped = isinstance(layout, OverlapSync)
        owners = {b.owner for b in layout.buckets} if overlapped else set()
        out.append(
            {
                "config": (interleaved, static, gabv),
                "same": same,
                "params": flat_params(pair[0]),
                "entries": len(layout.layout.entries) if overlapped else 0,
                "owners": owners,
            }
        )
    return out


def check(results, world_size):
    for rank_results in results:
        for r in rank_results:
            assert all(r["same"]), (r["config"], r["same"])
            assert r["entries"] >= 3, r  # laid out by DDP's (rebuilt) buckets
            assert r["owners"] == set(range(world_size)), r  # every rank steps some params
    for per_config in zip(*results):
        assert all(torch.equal(per_config[0]["params"], r["params"]) for r in per_config)


CONFIGS = [(i, s, False) for i in (False, True) for s in (False, True)]


@pytest.mark.parametrize("opt_name", list(OVERLAP_OPTIMIZERS))
@pytest.mark.parametrize("world", MULTI_RANK_WORLDS, ids=MULTI_RANK_WORLD_IDS)
def test_overlap_equals_ddp_and_unsharded_optimizer_from_the_first_iteration(pool, world, opt_name):
    """No warm-up: bit-identical to plain DDP (no hook) + the unsharded optimizer at every
    iteration, including the first (before DDP rebuilt its buckets) and across the rebuild;
    both schedules, static graph or not, two param groups, learning rates changed between
    iterations; replicas identical."""
    results = pool.run(parity_task, opt_name, CONFIGS, 5, timeout=60, **world)
    check(results, world.get("world_size", 2))


def test_gradient_as_bucket_view(pool):
    configs = [(i, False, True) for i in (False, True)]
    check(pool.run(parity_task, "adam", configs, 4, timeout=30, world_size=3), 3)


def hook_task(ctx, which):
    """A hand-registered ``overlap_hook`` with ``state=None`` (DDP's group, not WORLD: a
    2-rank task would hang on WORLD's 4 ranks), and a hook whose result is a new tensor."""

    def copying_hook(state, bucket):  # reduces a copy: the result is not bucket.buffer()
        tensor = bucket.buffer().div(dist.get_world_size(state))
        work = dist.all_reduce(tensor, group=state, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    hook = {"allreduce": allreduce_hook, "copying": copying_hook}[which]
    out = []
    for interleaved in (False, True):
        model = make_overlap_model()
        pair = build(ctx, copy.deepcopy(model), "adam", overlap=interleaved, hook=hook)
        ref = build(ctx, copy.deepcopy(model), "adam", hook=hook)
        out.append(train_both(ctx, pair, ref, range(4)))
    return out


@pytest.mark.parametrize("which", ["allreduce", "copying"])
def test_any_reduction_hook(pool, which):
    for result in pool.run(hook_task, which, world_size=3, timeout=30):
        assert result == [[True] * 4] * 2


def default_hook_task(ctx):
    model = make_overlap_model()
    plain, hooked = (
        DDP(copy.deepcopy(model), process_group=ctx.group),
        DDP(copy.deepcopy(model), process_group=ctx.group),
    )
    hooked.register_comm_hook(ctx.group, ddp_reduce_hook)
    for d in (plain, hooked):
        overlap_loss(d, 0, ctx.rank).backward()
    return all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), hooked.parameters()))


def test_ddp_reduce_hook_is_ddps_own_averaging_bit_for_bit(pool):
    """At world size 3 (1/3 is inexact) where torch's allreduce_hook differs by an ulp."""
    assert pool.run(default_hook_task, world_size=3) == [True] * 3


def wire_reference(ctx, model, wire):
    """What a wire dtype means, computed without oss_plus: plain DDP (its own averaging) and
    the unsharded Adam over exact master copies of every param (the same two groups), then
    every rank holds the master values rounded to ``wire``, its own params included (what
    travels: every replica is the same since issue 27; the owners keep the exact values as
    main copies). Returns the DDP model, its step and the masters."""
    cls, kwargs = OVERLAP_OPTIMIZERS["adam"]
    ddp = ddp_of(ctx, model)
    params = list(ddp.module.parameters())
    master = [p.detach().clone() for p in params]
    opt = cls([{"params": master[::2]}, {"params": master[1::2], "lr": kwargs["lr"] / 3}], **kwargs)

    @torch.no_grad()
    def step():
        for m, p in zip(master, params):
            m.grad = p.grad
        opt.step()
        for m, p in zip(master, params):
            p.copy_(m.to(wire).to(p.dtype))

    return ddp, step, master


def wire_task(ctx, interleaved):
    """bf16 on the wire: the overlapped step equals :func:`wire_reference` at every
    iteration, on every rank."""
    model = make_overlap_model()
    ddp, opt = build(
        ctx, copy.deepcopy(model), "adam", overlap=interleaved, broadcast_dtype=torch.bfloat16
    )
    ref_ddp, ref_step, master = wire_reference(ctx, copy.deepcopy(model), torch.bfloat16)
    same, rounded = [], []
    for it in range(4):
        for d in (ref_ddp, ddp):
            for p in d.parameters():
                p.grad = None
            overlap_loss(d, it, ctx.rank).backward()
        ref_step()
        same.append(params_equal(ddp, ref_ddp))
        pairs = zip(ref_ddp.parameters(), master)
        rounded.append(any(not torch.equal(p, m) for p, m in pairs))
    return same, rounded


@pytest.mark.parametrize("interleaved", [False, True])
def test_wire_dtype_equals_the_unsharded_step_rounded_on_the_wire(pool, interleaved):
    """Independent of the plain ``OSS.step()`` (which the no-op mutants of tests/noop break
    too): every rank holds the unsharded optimizer's values rounded to bf16, after every
    iteration."""
    for same, rounded in pool.run(wire_task, interleaved, world_size=2, timeout=30):
        assert same == [True] * 4
        assert all(rounded)  # the rounding is visible: bf16 differs from the masters


def reallocation_task(ctx):
    """Params given new storage between iterations (as module.to() does): laid out again."""
    model = make_overlap_model()
    pair = build(ctx, copy.deepcopy(model), "sgd_momentum", overlap=True)
    ref = build(ctx, copy.deepcopy(model), "sgd_momentum")
    same = train_both(ctx, pair, ref, range(3))
    with torch.no_grad():
        for p in pair[0].parameters():
            p.data = p.data.clone()
    same += train_both(ctx, pair, ref, range(3, 6))
    return same, pair[1].sync.is_intact()


def test_params_reallocated_between_iterations(pool):
    for same, intact in pool.run(reallocation_task, world_size=2, timeout=30):
        assert same == [True] * 6 and intact


# ------------------------------------------------------------------ state and checkpoints
def state_task(ctx, tmp, opt_name):
    model = make_overlap_model()
    pair = build(ctx, copy.deepcopy(model), opt_name, overlap=True)
    ref = build(ctx, copy.deepcopy(model), opt_name)
    assert all(train_both(ctx, pair, ref, range(4)))
    sd = pair[1].state_dict(all_ranks=True)
    same_sd = oss_plus_equal(sd, ref[1].state_dict())
    oss_plus.save_checkpoint(pair[1], tmp)
    pair2 = build(ctx, copy.deepcopy(pair[0].module), opt_name, overlap=False)
    oss_plus.load_checkpoint(pair2[1], tmp)
    ref2 = build(ctx, copy.deepcopy(ref[0].module), opt_name)
    ref2[1].load_state_dict(copy.deepcopy(ref[1].state_dict()))  # torch aliases otherwise
    return same_sd, train_both(ctx, pair2, ref2, range(4, 8))


def oss_plus_equal(a: dict, b: dict) -> bool:
    if sorted(a["state"]) != sorted(b["state"]) or a["param_groups"] != b["param_groups"]:
        return False
    return all(
        sorted(a["state"][k]) == sorted(b["state"][k])
        and all(
            torch.equal(torch.as_tensor(a["state"][k][n]), torch.as_tensor(b["state"][k][n]))
            for n in a["state"][k]
        )
        for k in a["state"]
    )


@pytest.mark.parametrize("opt_name", ["adam", "sgd_momentum"])
def test_state_dict_and_checkpoint(pool, tmp_path, opt_name):
    """The overlapped optimizer's state is the reference's; a checkpoint resumes exactly."""
    for same_sd, same in pool.run(
        state_task, str(tmp_path / "ckpt"), opt_name, world_size=2, timeout=30
    ):
        assert same_sd and same == [True] * 4


# ------------------------------------------------------------------ errors and warnings


def pairing_task(ctx):
    model = make_overlap_model()
    ddp = DDP(model, process_group=ctx.group)
    params = list(model.parameters())
    extra = torch.nn.Parameter(torch.zeros(3))
    other_group = SimpleNamespace(process_group=dist.group.WORLD, module=model)
    return {
        "plain": catch(check_pairing, ddp, torch.optim.SGD(params, lr=0.1)),
        "group": catch(check_pairing, other_group, OSS(params, group=ctx.group, lr=0.1)),
        "extra": catch(check_pairing, ddp, OSS([*params, extra], group=ctx.group, lr=0.1)),
        "subset": catch(check_pairing, ddp, OSS(params[:-1], group=ctx.group, lr=0.1)),
        "ok": catch(check_pairing, ddp, OSS(params, group=ctx.group, lr=0.1)),
    }


def test_ddp_and_optimizer_must_cover_the_same_ranks_and_params(pool):
    (r,) = pool.run(pairing_task, world_size=1)
    assert r["plain"][0] == "TypeError"
    assert r["group"] == ("ValueError", GROUP_MISMATCH.format(ddp=[0, 1, 2, 3], opt=[0]))
    assert r["extra"] == ("ValueError", PARAM_NOT_IN_DDP.format(index=8))
    assert r["subset"] == ("ValueError", PARAM_NOT_IN_OPTIMIZER.format(shape=(4,)))
    assert r["ok"] == ("ok", None)


def trainability_task(ctx, interleaved):
    model = make_overlap_model()
    frozen = list(model.parameters())[-1]
    frozen.requires_grad_(False)  # not reduced by DDP
    ddp = ddp_of(ctx, model)
    opt = OSS(ddp.module.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    overlap_with_ddp(ddp, opt, interleaved=interleaved)
    for it in range(2):
        opt.zero_grad()
        overlap_loss(ddp, it, ctx.rank).backward()
    frozen.requires_grad_(True)
    return catch(lambda: overlap_loss(ddp, 2, ctx.rank).backward())


@pytest.mark.parametrize("interleaved", [False, True])
def test_trainability_change_raises_on_every_rank(pool, interleaved):
    for result in pool.run(trainability_task, interleaved, world_size=2, timeout=30):
        assert result[0] == "RuntimeError" and PARAMS_CHANGED in result[1]


def step_task(ctx):
    with logged("oss_plus.overlap.layout") as messages:
        ddp, opt = build(ctx, make_overlap_model(), "sgd_momentum", overlap=False)
        for it in range(2):
            opt.zero_grad()
            overlap_loss(ddp, it, ctx.rank).backward()
            opt.step()  # a mistake: a second update
    return messages


def test_step_while_overlapped_warns_once(pool):
    for messages in pool.run(step_task, world_size=2):
        assert messages == [STEP_WHILE_OVERLAPPED]


# ------------------------------------------------------------------ the benchmark runs
def test_ddp_bench_smoke(tmp_path):
    """``python -m oss_plus bench --ddp`` in a tiny configuration (no timing asserts): every
    row runs, and the overlapped rows end bit-identical to DDP + the unsharded optimizer."""
    import json

    from oss_plus.cli import main

    rows = "oss_plus_overlap,oss_plus_overlap_interleaved,oss_plus,ddp_unsharded"
    argv = ["bench", "--ddp", "--size", "0.02", "--width", "32", "--rounds", "1", "--steps", "2"]
    assert main([*argv, "--impls", rows, "--warmup", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ddp_bench.json").read_text())
    assert list(data["rows"]) == rows.split(",")
    for row in data["rows"].values():
        assert row["iter_s"] > 0 and len(row["times_s"]) == 2
        assert row["max_diff_vs_unsharded"] == 0.0
    assert set(data["ratios"]) == {"oss_plus_overlap", "oss_plus_overlap_interleaved"}


# ------------------------------------------------------------------ NCCL (skipped without GPUs)
def nccl_rank(rank: int, world: int) -> list[bool]:
    """Both schedules of the core helper and of the torch adapter's hooks on NCCL, against
    DDP + the unsharded optimizer (the adapter after torch's 2-iteration warm-up)."""
    from oss_plus.compat.torch import (
        ZeroRedundancyOptimizer,
        hook_with_zero_step,
        hook_with_zero_step_interleaved,
    )

    device = torch.device("cuda", rank)
    out = []
    for adapter in (False, True):
        for interleaved in (False, True):
            model = make_overlap_model().to(device)
            ddp = DDP(copy.deepcopy(model), device_ids=[rank], bucket_cap_mb=BUCKET_CAP_MB)
            ref = DDP(copy.deepcopy(model), device_ids=[rank], bucket_cap_mb=BUCKET_CAP_MB)
            ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
            if adapter:
                ref.register_comm_hook(None, allreduce_hook)
                opt = ZeroRedundancyOptimizer(
                    ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
                )
                make = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
                ddp.register_comm_hook(None, make(allreduce_hook, ddp, opt))
            else:
                opt = OSS(ddp.parameters(), optim=torch.optim.Adam, lr=0.01)
                overlap_with_ddp(ddp, opt, interleaved=interleaved)
            for it in range(6):
                x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * rank + it))
                for d, o in ((ref, ref_opt), (ddp, opt)):
                    o.zero_grad()
                    d(x.to(device)).pow(2).mean().backward()
                if it >= (2 if adapter else 0):
                    ref_opt.step()
                torch.cuda.synchronize()
                out.append(
                    all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref.parameters()))
                )
    return out


@pytest.mark.gpu
def test_nccl_both_schedules():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from oss_plus.runtime.launch import run_local

    for result in run_local(nccl_rank, 2, backend="nccl", threads=1):
        assert result == [True] * 24
