"""An exception in one rank's local step raises on every rank, with no hang (issues 13, 27).

The optimizer, a closure or an inner-optimizer hook raises on ONE rank; every rank of the
group must raise, naming the failing rank and its error, after every broadcast completed
(the replicas hold the same values, and the group stays usable). Above world size 1 the
status travels with the buckets and is checked at the next call of the library (issue 27:
no host read per step), so every rank raises at the same call: ``settle()`` right after the
step, or the start of the next ``step()`` / ``clip_grad_norm()`` / consolidation. Timeouts
are small so that a hang fails fast.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from helpers import WORLD_IDS, WORLDS, backward, catch, flat_params, make_cut_model, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

import oss_plus.runtime.dist
from oss_plus import OSS
from oss_plus.runtime.dist import name_ranks
from oss_plus.wire.sync import TRANSPORT_ENV

#: Seconds a task may take: a hang fails the test fast.
TIMEOUT = 20
BOOM = "boom: the inner step failed on rank {rank}"


class FailingSGD(torch.optim.SGD):
    """SGD whose step, when ``fail`` is set, updates the first param of each group
    (a half-done step) and then raises IndexError."""

    fail = False

    @torch.no_grad()
    def step(self, closure=None):
        if not self.fail:
            return super().step(closure)
        for group in self.param_groups:
            if group["params"]:
                group["params"][0].add_(1.0)
        raise IndexError(BOOM.format(rank=dist.get_rank()))


def check_everyone_raised(results, failing, kind="IndexError", text=None, wire=None, members=None):
    """The failing rank raises its own error; every other rank one of the same type naming
    the failing rank (by its global rank: ``members`` are the group's, default 0, 1, ...) and
    its message; the replicas hold the same params (rounded to the wire dtype: each owner
    keeps its exact values)."""
    members = list(members or range(len(results)))
    text = text or BOOM.format(rank="")
    same = torch.equal if wire is None else (lambda a, b: torch.equal(a.to(wire), b.to(wire)))
    for rank, (outcome, after, _) in enumerate(results):
        name, message = outcome
        assert name == kind, (rank, outcome)
        assert text in message, (rank, message)
        if rank != failing:
            assert name_ranks(members, [failing]) + " failed (see" in message, message
            assert f"; global rank {members[failing]} raised {kind}: " in message, message
        assert same(after, results[0][1])  # every broadcast completed
    for _, _, later in results:
        assert same(later, results[0][2])  # the group is still usable afterwards


def make_optimizer(ctx, params, kind):
    if kind == "core":
        return OSS(params, optim=FailingSGD, group=ctx.group, lr=0.1)
    if kind == "flat":  # the flat rule (with make_cut_model: ranges that carry slots)
        optim = oss_plus.elementwise(FailingSGD)
        return OSS(params, optim=optim, group=ctx.group, partition_rule="flat", lr=0.1)
    if kind == "fairscale":
        from oss_plus.compat.fairscale import OSS as FairscaleOSS

        return FairscaleOSS(params, optim=FailingSGD, group=ctx.group, lr=0.1)
    from oss_plus.compat.torch import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        params,
        FailingSGD,
        process_group=ctx.group,
        parameters_as_bucket_view=kind == "torch_bucket_view",
        lr=0.1,
    )


@contextlib.contextmanager
def transport(name):
    os.environ[TRANSPORT_ENV] = name
    try:
        yield
    finally:
        del os.environ[TRANSPORT_ENV]


def fail_task(
    ctx, failing, kind="core", via="broadcast", wire=None, how="optimizer", then="settle"
):
    model = make_cut_model() if kind == "flat" else make_model()
    with transport(via):
        opt = make_optimizer(ctx, model.parameters(), kind)
    opt.broadcast_dtype = wire
    backward(model, 0)
    opt.step()  # a good step first
    opt.zero_grad()
    backward(model, 1)
    closure, handle = None, None
    if ctx.rank == failing:
        if how == "optimizer":
            opt.optim.fail = True
        elif how == "closure":

            def closure():
                raise KeyError("the closure failed")

        else:

            def hook(optimizer, args, kwargs):
                raise ValueError("an inner step pre-hook failed")

            handle = opt.optim.register_step_pre_hook(hook)
    stepped = catch(opt.step, closure)
    after = flat_params(model)
    if ctx.world_size > 1:  # the step returned on every rank: the check raises
        assert stepped == ("ok", None), stepped
        stepped = check_later(opt, model, then)
        assert torch.equal(flat_params(model), after)  # nothing stepped before raising
    opt.optim.fail = False
    if handle is not None:
        handle.remove()
    opt.zero_grad()
    backward(model, 2)
    opt.step()  # every rank goes on together
    return stepped, after, flat_params(model)


def check_later(opt, model, then):
    """The call after a failed step that raises on every rank: ``settle()``, or the next
    iteration's ``step()`` or ``clip_grad_norm()`` (which raise before doing anything)."""
    if then == "settle":
        return catch(opt.settle)
    opt.zero_grad()
    backward(model, 5)
    return catch(opt.step if then == "step" else lambda: opt.clip_grad_norm(1.0))


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_a_failing_inner_step_raises_on_every_rank(pool, world):
    size = len(world.get("ranks", ())) or world["world_size"]
    failing = size - 1
    results = pool.run(fail_task, failing, timeout=TIMEOUT, **world)
    check_everyone_raised(results, failing, members=world.get("ranks"))


@pytest.mark.parametrize("then", ["step", "clip"])
def test_without_settle_the_next_step_or_clip_raises_on_every_rank(pool, then):
    results = pool.run(fail_task, 1, "core", "broadcast", None, "optimizer", then, world_size=3)
    check_everyone_raised(results, 1)


@pytest.mark.parametrize("via", ["broadcast", "all_gather"])
@pytest.mark.parametrize("wire", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_transport_and_compression_carries_the_failure(pool, via, wire):
    results = pool.run(fail_task, 0, "core", via, wire, world_size=3, timeout=TIMEOUT)
    check_everyone_raised(results, 0, wire=wire)


@pytest.mark.parametrize("via", ["broadcast", "all_gather"])
@pytest.mark.parametrize("wire", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_flat_rule_carries_the_failure_in_its_ranges(pool, via, wire):
    results = pool.run(fail_task, 2, "flat", via, wire, world_size=3, timeout=TIMEOUT)
    check_everyone_raised(results, 2, wire=wire)


@pytest.mark.parametrize("kind", ["fairscale", "torch", "torch_bucket_view"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "off"])
def test_the_adapters_raise_on_every_rank(pool, kind, world):
    results = pool.run(fail_task, 1, kind, timeout=TIMEOUT, **world)
    check_everyone_raised(results, 1, members=world.get("ranks"))


@pytest.mark.parametrize(
    "how, kind, text", [("closure", "KeyError", "closure"), ("hook", "ValueError", "pre-hook")]
)
def test_a_failing_closure_or_inner_hook_raises_on_every_rank(pool, how, kind, text):
    results = pool.run(fail_task, 1, "core", "broadcast", None, how, world_size=3, timeout=TIMEOUT)
    check_everyone_raised(results, 1, kind, text)


def owns_nothing_task(ctx):
    """3 ranks, 2 params: rank 2 owns nothing and its step raises (the LBFGS case)."""
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    opt = OSS(params, optim=FailingSGD, group=ctx.group, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    owned = sum(len(g["params"]) for g in opt.optim.param_groups)
    opt.optim.fail = ctx.rank == 2
    assert catch(opt.step) == ("ok", None)
    outcome = catch(opt.settle)
    return outcome, owned, torch.cat([p.detach() for p in params])


def test_a_rank_that_owns_nothing_still_reports_its_failure(pool):
    results = pool.run(owns_nothing_task, world_size=3, timeout=TIMEOUT)
    assert [owned for _, owned, _ in results] == [1, 1, 0]
    for rank, (outcome, _, after) in enumerate(results):
        assert outcome[0] == "IndexError" and "boom" in outcome[1], outcome
        assert rank == 2 or "global rank(s) [2]" in outcome[1]
        assert torch.equal(after, torch.full((7,), 0.9))  # the two owners' steps arrived


def collectives_task(ctx, n_params, rule="fairscale"):
    """The collectives of 3 good steps: their kinds, how often ``agree`` ran, the buckets,
    the params cut across ranks, and the params against 3 plain SGD updates."""
    from oss_plus.wire import status

    calls, seen = [], []
    original, broadcast, gather = (
        oss_plus.runtime.dist.agree,
        dist.broadcast,
        status._all_gather_single,
    )

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def counting_broadcast(*args, **kwargs):
        seen.append("broadcast")
        return broadcast(*args, **kwargs)

    def counting_gather(*args, **kwargs):
        seen.append("status all_gather")
        return gather(*args, **kwargs)

    sizes = {"flat": [36, 6] * 29, "flat_wide": [13 * (i + 1) for i in range(n_params)]}.get(
        rule, [5 + i for i in range(n_params)]
    )  # flat: a cut param of 36 elements in 1218 (slots); flat_wide: 117 in 273 (no slots)
    params = [torch.nn.Parameter(torch.ones(n)) for n in sizes]
    rule = "flat" if rule == "flat_wide" else rule
    opt = OSS(params, optim=torch.optim.SGD, group=ctx.group, lr=0.1, partition_rule=rule)
    patched = (counting, counting_broadcast, counting_gather)
    oss_plus.runtime.dist.agree, dist.broadcast, status._all_gather_single = patched
    try:
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    finally:
        oss_plus.runtime.dist.agree, dist.broadcast, status._all_gather_single = (
            original,
            broadcast,
            gather,
        )
    want = torch.ones(sum(p.numel() for p in params))
    for _ in range(3):
        want.add_(torch.ones_like(want), alpha=-0.1)  # what plain SGD does
    got = torch.cat([p.detach().reshape(-1) for p in params])
    return len(calls), seen, len(opt.sync.buckets), len(opt.plan.split), torch.equal(got, want)


def test_no_extra_collective_unless_a_rank_sends_no_bucket(pool):
    """Every rank sends a bucket: the buckets alone, no agree. A rank owning nothing (3 ranks,
    2 params): one small status all_gather per step, started with the buckets (no agree)."""
    runs = pool.run(collectives_task, 6, world_size=3, timeout=TIMEOUT)
    for agreed, seen, buckets, _, right in runs:
        assert agreed == 0 and seen == ["broadcast"] * buckets * 3 and right, seen
    runs = pool.run(collectives_task, 2, world_size=3, timeout=TIMEOUT)
    for agreed, seen, buckets, _, right in runs:
        assert agreed == 0 and buckets == 2 and right
        assert seen == ["status all_gather", "broadcast", "broadcast"] * 3, seen


def test_the_flat_rule_sends_its_status_in_its_ranges(pool):
    """The flat rule on 3 ranks, a param cut by a range boundary: one broadcast per range and
    per step, no status all_gather (the ranges carry slots); where the cut params hold more
    than ``SLOTTED_SHARE`` of the elements, the ranges stay back to back and one small status
    all_gather goes with them. The params are what plain SGD gives in both."""
    runs = pool.run(collectives_task, 6, "flat", world_size=3, timeout=TIMEOUT)
    for agreed, seen, buckets, split, right in runs:
        assert split >= 1 and buckets == 3 and right
        assert agreed == 0 and seen == ["broadcast"] * 3 * 3, seen
    runs = pool.run(collectives_task, 6, "flat_wide", world_size=3, timeout=TIMEOUT)
    for agreed, seen, buckets, split, right in runs:
        assert split >= 2 and buckets == 3 and right
        assert agreed == 0 and seen == (["status all_gather"] + ["broadcast"] * 3) * 3, seen


# ------------------------------------------------------------------ the overlapped step
def overlap_task(ctx, failing, interleaved):
    from oss_plus.overlap import overlap_with_ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 60), torch.nn.Linear(60, 4))
    ddp = DDP(model, process_group=ctx.group, bucket_cap_mb=0.0006)
    opt = OSS(ddp.parameters(), optim=FailingSGD, group=ctx.group, lr=0.1)
    overlap_with_ddp(ddp, opt, interleaved=interleaved)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(ctx.rank))
    for it in range(3):
        opt.zero_grad()
        opt.optim.fail = it == 2 and ctx.rank == failing
        outcome = catch(lambda: ddp(x).pow(2).mean().backward())
    return outcome, flat_params(model), None


@pytest.mark.parametrize("interleaved", [False, True], ids=["after_last", "interleaved"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "off"])
def test_the_overlapped_step_raises_on_every_rank(pool, interleaved, world):
    results = pool.run(overlap_task, 1, interleaved, timeout=TIMEOUT, **world)
    named = name_ranks(list(world.get("ranks", range(len(results)))), [1]) + " failed"
    for rank, (outcome, after, _) in enumerate(results):
        assert outcome[0] == "IndexError" and "boom" in outcome[1], (rank, outcome)
        assert rank == 1 or named in outcome[1], outcome
        assert torch.equal(after, results[0][1])
