"""Differential suite for ``overlap_with_ddp=True``: oss_plus.compat.torch's ZeroRedundancyOptimizer
with its ``hook_with_zero_step`` / ``hook_with_zero_step_interleaved`` against DDP + the
unsharded optimizer (torch's own hooks refuse gloo; torch's tests compare the same way), and
against torch's own code where it runs here (the bucket assignment rule; the errors of its
non-interleaved hook with the gloo guard bypassed).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import (
    MULTI_RANK_WORLD_IDS,
    MULTI_RANK_WORLDS,
    OVERLAP_OPTIMIZERS,
    catch,
    ddp_of,
    logged,
    make_overlap_model,
    overlap_loss,
    same_value,
)
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import oss_plus
from oss_plus.compat.ddp_zero_hook import NOT_OVERLAP, TRAINABILITY_CHANGED
from oss_plus.compat.torch import (
    OVERLAP_ONE_GROUP,
    OVERLAP_STEP,
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from oss_plus.overlap.plan import local_order, torch_assignments

pytestmark = pytest.mark.compat

#: (interleaved, static_graph, shard_buckets, gradient_as_bucket_view)
CONFIGS = [(i, s, b, False) for i in (False, True) for s in (False, True) for b in (False, True)]
#: Iterations torch's hooks do not update: DDP's buckets are final from the 2nd (3rd) one.
WARMUP = {False: 2, True: 3}


def overlapped(
    ctx: Any,
    model: torch.nn.Module,
    opt_name: str,
    interleaved: bool = False,
    static: bool = False,
    shard: bool = False,
    gabv: bool = False,
) -> tuple[DDP, ZeroRedundancyOptimizer]:
    """DDP + ZeroRedundancyOptimizer(overlap_with_ddp=True) + hook, as torch's docs show."""
    cls, kwargs = OVERLAP_OPTIMIZERS[opt_name]
    ddp = ddp_of(ctx, model, static, gabv)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), cls, process_group=ctx.group, overlap_with_ddp=True, **kwargs
    )
    make = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    ddp.register_comm_hook(None, make(allreduce_hook, ddp, zero, shard_buckets=shard))
    return ddp, zero


def reference(
    ctx: Any, model: torch.nn.Module, opt_name: str, static: bool = False
) -> tuple[DDP, Any]:
    """DDP with the same reduction (``allreduce_hook``: DDP's built-in one rounds differently
    at world size 3) + the unsharded optimizer."""
    cls, kwargs = OVERLAP_OPTIMIZERS[opt_name]
    ddp = ddp_of(ctx, model, static)
    ddp.register_comm_hook(ctx.group, allreduce_hook)
    return ddp, cls(ddp.parameters(), **kwargs)


def run_pair(ctx: Any, pair: tuple[DDP, Any, DDP, Any], iters: range, warmup: int) -> list[bool]:
    """Train both; the reference skips step() during the warm-up. Equality per iteration."""
    ddp, zero, ref_ddp, ref_opt = pair
    same = []
    for it in iters:
        zero.zero_grad()
        ref_opt.zero_grad()
        overlap_loss(ref_ddp, it, ctx.rank).backward()
        if it >= warmup:
            ref_opt.step()
        overlap_loss(ddp, it, ctx.rank).backward()
        same.append(all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref_ddp.parameters())))
    return same


# ------------------------------------------------------------------ parity with DDP + unsharded
def parity_task(ctx, opt_name, configs, iters):
    out = []
    for interleaved, static, shard, gabv in configs:
        model = make_overlap_model()
        start = [p.detach().clone() for p in model.parameters()]
        ddp, zero = overlapped(
            ctx, copy.deepcopy(model), opt_name, interleaved, static, shard, gabv
        )
        ref_ddp, ref_opt = reference(ctx, copy.deepcopy(model), opt_name, static)
        same = run_pair(ctx, (ddp, zero, ref_ddp, ref_opt), range(iters), WARMUP[static])
        moved = not all(torch.equal(a, b) for a, b in zip(start, ddp.parameters()))
        plan = zero._overlap
        owners = sorted({a.owner for a in plan.assignments}) if plan else []
        out.append(
            {
                "config": (interleaved, static, shard, gabv),
                "same": same,
                "moved": moved,
                "buckets": len(plan.bucket_ids) if plan else 0,
                "assignments": len(plan.assignments) if plan else 0,
                "owners": owners,
                "params": torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]),
            }
        )
    return out


def check_parity(results: list[list[dict[str, Any]]], world_size: int) -> None:
    for rank_results in results:
        for r in rank_results:
            assert all(r["same"]), (r["config"], r["same"])
            assert r["moved"], r["config"]  # the steps after the warm-up did update
            assert r["buckets"] >= 3, r  # several DDP buckets, so bucket order matters
            interleaved, static, shard, gabv = r["config"]
            if shard:
                assert r["assignments"] > r["buckets"], r  # some bucket is cut across ranks
                assert set(r["owners"]) <= set(range(world_size)) and len(r["owners"]) > 1, r
            else:  # bucket b to rank b % world_size
                assert r["owners"] == list(range(min(world_size, r["buckets"]))), r
    for per_config in zip(*results):  # replicas identical on every rank
        assert all(torch.equal(per_config[0]["params"], r["params"]) for r in per_config)


@pytest.mark.parametrize("opt_name", list(OVERLAP_OPTIMIZERS))
@pytest.mark.parametrize("world", MULTI_RANK_WORLDS, ids=MULTI_RANK_WORLD_IDS)
def test_hooks_equal_ddp_and_unsharded_optimizer_after_torchs_warmup(pool, world, opt_name):
    """Both hooks, static graph or not, sharded buckets or not: bit-identical to DDP + the
    unsharded optimizer at every iteration, where the reference skips step() during
    exactly 2 (static_graph: 3) warm-up iterations: so the warm-up is exactly torch's."""
    results = pool.run(parity_task, opt_name, CONFIGS, 6, timeout=60, **world)
    check_parity(results, world.get("world_size", 2))


def test_gradient_as_bucket_view(pool):
    """DDP's grads as views of its buckets: the reduced values are read the same way."""
    configs = [(i, False, b, True) for i in (False, True) for b in (False, True)]
    check_parity(pool.run(parity_task, "adam", configs, 5, timeout=30, world_size=2), 2)


# ------------------------------------------------------------------ the assignment rule = torch's
def assignment_task(ctx, layouts, shard):
    """torch's own ``_bucket_assignments_per_rank`` for given bucket layouts, and ours."""
    out = []
    for sizes in layouts:
        buckets = [[torch.nn.Parameter(torch.zeros(n)) for n in bucket] for bucket in sizes]
        flat = [p for b in buckets for p in b]
        zero = TorchZero(
            flat, torch.optim.SGD, process_group=ctx.group, overlap_with_ddp=True, lr=0.1
        )
        info = zero._overlap_info
        info.params_per_bucket = buckets
        info.shard_buckets = shard
        info.total_size = sum(sum(b) for b in sizes)
        info.status = type(info.status).INITIALIZED
        theirs = sorted(
            (index, rank, a.offset, a.offset + len(a.parameters))
            for rank, per_rank in enumerate(zero._bucket_assignments_per_rank)
            for index, a in per_rank.items()
        )
        mine = sorted(
            (a.bucket, a.owner, a.start, a.stop)
            for a in torch_assignments(sizes, ctx.world_size, shard)
        )
        ids = {id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket)}
        torch_local = [[ids[id(p)] for p in ps] for ps in info.params_per_rank]
        my_local = [
            local_order(torch_assignments(sizes, ctx.world_size, shard), r)
            for r in range(ctx.world_size)
        ]
        out.append((theirs == mine, torch_local == my_local))
    return out


LAYOUTS = [
    [[5, 3], [40], [7, 7, 7], [1], [12, 30, 2]],
    [[100], [1, 1, 1, 1], [50, 50], [3]],
    [[8, 8, 8, 8, 8, 8], [16, 16], [64]],
]


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "shard_buckets"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_assignments_are_torchs(pool, world_size, shard):
    """The bucket-to-rank assignment and each rank's local param order are torch's exactly
    (computed by torch's ZeroRedundancyOptimizer itself on the same bucket layouts)."""
    for result in pool.run(assignment_task, LAYOUTS, shard, world_size=world_size):
        assert result == [(True, True)] * len(LAYOUTS)


# ------------------------------------------------------------------ unsupported: torch's errors
@contextlib.contextmanager
def torch_gloo_guard_bypassed() -> Iterator[None]:
    """torch's hooks refuse gloo at creation; their non-interleaved hook runs fine on it."""
    original = dist.get_backend
    torch_hooks.dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_hooks.dist.get_backend = original


def several_groups_task(ctx, torch_side):
    if not torch_side:
        model = make_overlap_model()
        groups = [
            {"params": list(model.parameters())[:4]},
            {"params": list(model.parameters())[4:]},
        ]
        return catch(
            ZeroRedundancyOptimizer,
            groups,
            torch.optim.SGD,
            process_group=ctx.group,
            overlap_with_ddp=True,
            lr=0.1,
        )
    # torch accepts them at construction and fails inside the backward after its warm-up
    ddp = ddp_of(ctx, make_overlap_model())
    ps = list(ddp.parameters())
    zero = TorchZero(
        [{"params": ps[:4]}, {"params": ps[4:]}],
        torch.optim.SGD,
        process_group=ctx.group,
        overlap_with_ddp=True,
        lr=0.1,
    )
    with torch_gloo_guard_bypassed():
        hook = torch_hooks.hook_with_zero_step(allreduce_hook, ddp, zero)
    ddp.register_comm_hook(ctx.group, hook)
    return [catch(lambda it=it: overlap_loss(ddp, it, ctx.rank).backward()) for it in range(3)]


def test_several_param_groups_raise_runtime_error(pool):
    """torch: RuntimeError in the first backward after the warm-up; here: the same type at
    construction (on every rank), before any training. (torch's side runs on one rank: its
    hooks raise on the ranks at different points, which desynchronizes a group.)"""
    for mine in pool.run(several_groups_task, False, world_size=2):
        assert mine == ("RuntimeError", OVERLAP_ONE_GROUP)
    (theirs,) = pool.run(several_groups_task, True, world_size=1)
    assert theirs[0] == theirs[1] == ("ok", None)
    assert theirs[2][0] == "RuntimeError" and "single parameter group" in theirs[2][1]


def add_group_task(ctx):
    out = []
    for cls in (ZeroRedundancyOptimizer, TorchZero):
        model = make_overlap_model()
        ps = list(model.parameters())
        zero = cls(ps[:4], torch.optim.SGD, process_group=ctx.group, overlap_with_ddp=True, lr=0.1)
        out.append(catch(zero.add_param_group, {"params": ps[4:]}))
    return out


def test_add_param_group_raises_as_torch(pool):
    for mine, theirs in pool.run(add_group_task, world_size=2):
        assert mine == theirs == ("RuntimeError", OVERLAP_ONE_GROUP)


def trainability_task(ctx, torch_side):
    model = make_overlap_model()
    last_bias = list(model.parameters())[-1]
    last_bias.requires_grad_(False)  # frozen when DDP is built: DDP never reduces it
    ddp = ddp_of(ctx, model)
    zero = (TorchZero if torch_side else ZeroRedundancyOptimizer)(
        ddp.module.parameters(),
        torch.optim.SGD,
        process_group=ctx.group,
        overlap_with_ddp=True,
        lr=0.1,
    )
    if torch_side:
        with torch_gloo_guard_bypassed():
            ddp.register_comm_hook(
                ctx.group, torch_hooks.hook_with_zero_step(allreduce_hook, ddp, zero)
            )
    else:
        ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    for it in range(4):
        zero.zero_grad()
        overlap_loss(ddp, it, ctx.rank).backward()
    last_bias.requires_grad_(True)
    zero.zero_grad()
    return catch(lambda: overlap_loss(ddp, 4, ctx.rank).backward())


def test_trainability_change_raises_as_torch(pool):
    """Unfreezing a param after initialization: RuntimeError with torch's message out of
    backward() on every rank, as torch's hook raises it (torch's side on one rank: its hook
    raises after some ranks issued a broadcast, which desynchronizes a group)."""
    mine = pool.run(trainability_task, False, world_size=2, timeout=30)
    theirs = pool.run(trainability_task, True, world_size=1, timeout=30)
    for result in mine + theirs:
        assert result[0] == "RuntimeError" and TRAINABILITY_CHANGED in result[1], result


def not_overlap_task(ctx):
    ddp = ddp_of(ctx, make_overlap_model())
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.SGD, process_group=ctx.group, lr=0.1
    )
    return [
        catch(make, allreduce_hook, ddp, zero)
        for make in (hook_with_zero_step, hook_with_zero_step_interleaved)
    ]


def test_hooks_need_an_overlap_optimizer(pool):
    for result in pool.run(not_overlap_task, world_size=2):
        assert result == [("ValueError", NOT_OVERLAP)] * 2


def step_task(ctx):
    with logged("oss_plus.compat.torch") as messages:
        ddp, zero = overlapped(ctx, make_overlap_model(), "sgd_momentum")
        for it in range(3):
            zero.zero_grad()
            overlap_loss(ddp, it, ctx.rank).backward()
        before = [p.detach().clone() for p in ddp.parameters()]
        returned = zero.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    return returned, unchanged, messages


def test_step_warns_and_does_nothing(pool):
    """As torch: step() in the loop logs a warning and returns None without updating."""
    for returned, unchanged, messages in pool.run(step_task, world_size=2):
        assert returned is None and unchanged and OVERLAP_STEP in messages


# ------------------------------------------------------------------ state dicts and checkpoints
def state_task(ctx, tmp, opt_name):
    """After training: consolidated state = the reference's; reload and checkpoints before
    the new optimizer's initialization (torch raises there) hold the same state, which
    moves to its owners at initialization: training continues exactly like the reference."""
    model = make_overlap_model()
    ddp, zero = overlapped(ctx, copy.deepcopy(model), opt_name, interleaved=True)
    ref_ddp, ref_opt = reference(ctx, copy.deepcopy(model), opt_name)
    assert all(run_pair(ctx, (ddp, zero, ref_ddp, ref_opt), range(5), 2))
    zero.consolidate_state_dict(to=0)
    sd = zero.state_dict() if ctx.rank == 0 else None
    same_sd = sd is None or same_value(sd, ref_opt.state_dict())
    oss_plus.save_checkpoint(zero, tmp)
    shared = [None]
    shared[0] = sd
    dist.broadcast_object_list(shared, src=dist.get_global_rank(ctx.group, 0), group=ctx.group)
    out = {"same_sd": same_sd}
    for how in ("load_state_dict", "load_checkpoint"):
        model2 = copy.deepcopy(ddp.module)
        ddp2, zero2 = overlapped(ctx, model2, opt_name, shard=True)
        if how == "load_state_dict":
            zero2.load_state_dict(shared[0])  # before initialization: moved at init
        else:
            oss_plus.load_checkpoint(zero2, tmp)
        zero2.consolidate_state_dict(to=0)  # torch: RuntimeError before initialization
        if ctx.rank == 0:
            out[how + "_before_init"] = same_value(zero2.state_dict(), ref_opt.state_dict())
        ref2 = reference(ctx, copy.deepcopy(ref_ddp.module), opt_name)
        ref2[1].load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # torch aliases otherwise
        out[how] = run_pair(ctx, (ddp2, zero2, *ref2), range(5, 10), 5 + 2)
        zero2.consolidate_state_dict(to=0)
        if ctx.rank == 0:
            out[how + "_sd"] = same_value(zero2.state_dict(), ref2[1].state_dict())
    return out


@pytest.mark.parametrize("opt_name", ["adam", "sgd_momentum"])
def test_state_dict_and_checkpoint_after_initialization(pool, tmp_path, opt_name):
    results = pool.run(state_task, str(tmp_path / "ckpt"), opt_name, world_size=2, timeout=60)
    for rank, r in enumerate(results):
        assert r["same_sd"]
        assert all(r["load_state_dict"]) and all(r["load_checkpoint"]), r
        if rank == 0:
            assert r["load_state_dict_sd"] and r["load_checkpoint_sd"]
            assert r["load_state_dict_before_init"] and r["load_checkpoint_before_init"]
