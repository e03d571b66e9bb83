"""Differential suite: fairscale's ShardedDataParallel + OSS (0.4.13) against oss_plus's.

The same model, data and calls go through ``fairscale.nn.data_parallel.ShardedDataParallel``
over ``fairscale.optim.OSS`` and through ``oss_plus.ShardedDataParallel`` over
``oss_plus.compat.fairscale.OSS`` (same partition), on the same ranks.

* fairscale with ``reduce_buffer_size=0`` (its only setting that matches DDP, FINDINGS.md)
  against oss_plus with ``find_unused_parameters=False`` (fairscale's behaviour: no used
  flags, an unused param gets the zero sum): with one param per bucket bit-identical on
  every world size (the same tensors reduced in the same order; with freezing on 3-4 ranks
  within 1e-5, cause not isolated); with buckets, bit-identical on 1-2 ranks and within
  1e-5 on 3-4 (gloo's sum order follows the buffer layout).
* oss_plus's default (``find_unused_parameters=True``) sends one flag per param after each
  bucket's gradients, so its buffers are longer than fairscale's: bit-identical on 1-2
  ranks, within 1e-5 on 3-4 (the layout again).
* on a subgroup without global rank 0 (ranks [2, 3]) fairscale drops every gradient
  (it compares the group-local owner with the global rank), so nothing trains; oss_plus
  matches DDP + OSS there (tests/test_sdp.py).
* fairscale with its default ``reduce_buffer_size=2**23`` drifts from DDP + OSS; oss_plus
  with the same setting does not.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("fairscale")

from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP  # noqa: E402
from fairscale.optim import OSS as FairscaleOSS  # noqa: E402
from helpers import WORLD_IDS, WORLDS, batch, make_diff_model  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from oss_plus import ShardedDataParallel  # noqa: E402
from oss_plus.compat.fairscale import OSS  # noqa: E402

pytestmark = pytest.mark.compat

BUCKETS = [0, 64, 2**23]


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _train(ctx, net, opt, steps, accumulate, freeze_at):
    for step in range(steps):
        if freeze_at is not None:
            net.module[0].weight.requires_grad_(not freeze_at <= step < freeze_at + 2)
        opt.zero_grad()
        for micro in range(accumulate):
            with net.no_sync():
                net(batch(100 + micro, width=8, n=6, rank=ctx.rank)).pow(2).mean().backward()
        net(batch(step, width=8, n=6, rank=ctx.rank)).pow(2).mean().backward()
        opt.step()


def diff_task(
    ctx, ours_bucket, theirs_bucket, accumulate=0, freeze_at=None, steps=4, find_unused=False
):
    model = make_diff_model()
    theirs_model, ours_model = copy.deepcopy(model), copy.deepcopy(model)
    kwargs = {"optim": torch.optim.Adam, "group": ctx.group, "lr": 0.01}
    theirs_opt = FairscaleOSS(theirs_model.parameters(), **kwargs)
    theirs = FairscaleSDP(theirs_model, theirs_opt, ctx.group, reduce_buffer_size=theirs_bucket)
    ours_opt = OSS(ours_model.parameters(), **kwargs)
    ours = ShardedDataParallel(
        ours_model,
        ours_opt,
        ctx.group,
        reduce_buffer_size=ours_bucket,
        find_unused_parameters=find_unused,
    )
    _train(ctx, theirs, theirs_opt, steps, accumulate, freeze_at)
    _train(ctx, ours, ours_opt, steps, accumulate, freeze_at)
    a, b = _flat(theirs_model), _flat(ours_model)
    return {"exact": torch.equal(a, b), "diff": float((a - b).abs().max())}


@pytest.mark.parametrize("world", WORLDS[:4], ids=WORLD_IDS[:4])  # offset23: see below
@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize(
    "scenario",
    [{}, {"accumulate": 2}, {"freeze_at": 1, "steps": 5}],
    ids=["plain", "no_sync", "freeze"],
)
def test_matches_fairscale_with_reduce_buffer_size_0(pool, world, bucket, scenario):
    results = pool.run(diff_task, bucket, 0, **scenario, **world)
    small = world.get("world_size", 2) <= 2
    # 3-4 ranks with freezing: within 3e-8 of fairscale, not bit-identical (cause not isolated)
    exact = small or (bucket == 0 and "freeze_at" not in scenario)
    for r in results:
        assert r["exact"] if exact else r["diff"] < 1e-5, r


@pytest.mark.parametrize("world", WORLDS[:4], ids=WORLD_IDS[:4])
def test_the_default_with_its_flags_matches_fairscale_within_the_sum_order(pool, world):
    results = pool.run(diff_task, 0, 0, find_unused=True, **world)
    for r in results:
        assert r["exact"] if world.get("world_size", 2) <= 2 else r["diff"] < 1e-5, r


def drift_task(ctx, bucket):
    """fairscale SDP and oss_plus SDP with the same bucket size, each against DDP + OSS."""
    model = make_diff_model()
    copies = [copy.deepcopy(model) for _ in range(3)]
    kwargs = {"optim": torch.optim.Adam, "group": ctx.group, "lr": 0.01}
    opts = [FairscaleOSS(copies[0].parameters(), **kwargs), OSS(copies[1].parameters(), **kwargs)]
    opts.append(OSS(copies[2].parameters(), **kwargs))
    nets = [
        FairscaleSDP(copies[0], opts[0], ctx.group, reduce_buffer_size=bucket),
        ShardedDataParallel(copies[1], opts[1], ctx.group, reduce_buffer_size=bucket),
        DDP(copies[2], process_group=ctx.group),
    ]
    for net, opt in zip(nets, opts):
        _train(ctx, net, opt, 5, 0, None)
    ref = _flat(copies[2])
    return [float((_flat(m) - ref).abs().max()) for m in copies[:2]]


def test_fairscale_default_buckets_drift_from_ddp_ours_do_not(pool):
    for theirs, ours in pool.run(drift_task, 2**23, world_size=2):
        assert theirs > 1e-3  # FINDINGS.md: 5e-2 after 5 steps
        assert ours == 0.0


def offset_task(ctx):
    model = make_diff_model()
    theirs_model = copy.deepcopy(model)
    opt = FairscaleOSS(theirs_model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    net = FairscaleSDP(theirs_model, opt, ctx.group, reduce_buffer_size=0)
    net(batch(0, width=8, n=6, rank=ctx.rank)).pow(2).mean().backward()
    kept = sum(p.grad is not None for p in theirs_model.parameters())
    opt.step()
    return kept, torch.equal(_flat(theirs_model), _flat(model))


def test_fairscale_on_an_offset_subgroup_drops_every_gradient(pool):
    for kept, unchanged in pool.run(offset_task, ranks=(2, 3)):
        assert kept == 0 and unchanged  # fairscale defect; oss_plus: tests/test_sdp.py
