"""A plain ``torch.amp.GradScaler`` over ShardedDataParallel + OSS, under every partition
rule, against DDP + the unsharded optimizer + the same scaler.

Under ZeRO-2 a rank holds only the gradients it owns (and, with the flat rule, the pieces of
cut params, which no ``.grad`` holds). The scaler hands ``grad_scale`` and ``found_inf`` to
``OSS.step`` (torch's ``_step_supports_amp_scaling`` contract), which unscales what is left
and agrees with every rank. Expected, per iteration: the reference's params and scale (bit
for bit where the reduction's sum is, within the summation-order bound elsewhere), the inf
step skipped on every rank; or a refusal raised on every rank with the params untouched,
where the scaler cannot be followed exactly: a rank whose scaler saw no inf/NaN (its
``update()`` would not back off; decided here from the ``.grad`` each rank holds) or, after
``unscale_()``, piece gradients it could not unscale. ``ShardedGradScaler`` is never refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import catch
from sdp_utils import Net, batch, flat, max_diff
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel, ShardedGradScaler
from oss_plus.amp.scaler import PIECES_NOT_UNSCALED, SCALES_WOULD_DIFFER

#: Rank 0's loss times inf (every reduced gradient turns non-finite), then an inf in the
#: gradient of one param on rank 0 only (it reaches that param's owner only).
LOSS_INF, PARAM_INF = 2, 4
STEPS, CLIP = 6, 0.05
WORLDS = {"ws2": {"world_size": 2}, "ws3": {"world_size": 3}, "offset23": {"ranks": (2, 3)}}
EXACT = {"ws2", "offset23"}  # a sum of two terms is the same in any order


def _poison(param: torch.nn.Parameter):
    return param.register_hook(lambda g: torch.full_like(g, float("inf")))


def _iteration(net, opt, scaler, x, clip, poison, factor=1.0):
    """One scaled iteration; returns (what the scaler sees: a non-finite .grad here,
    piece gradients held, clip total, the step's outcome)."""
    handle = _poison(net.module.head.bias) if poison else None
    opt.zero_grad()
    scaler.scale(net(x).pow(2).mean() * factor).backward()
    if handle is not None:
        handle.remove()
    grads = [p.grad for p in net.module.parameters() if p.grad is not None]
    sees = any(not torch.isfinite(g).all() for g in grads)
    held = len(opt.piece_grads()) if isinstance(opt, OSS) else 0
    total = None

    def step():
        nonlocal total
        if clip:
            scaler.unscale_(opt)
            params = net.module.parameters()
            total = opt.clip_grad_norm(CLIP) if isinstance(opt, OSS) else (
                torch.nn.utils.clip_grad_norm_(params, CLIP))  # fmt: skip
        scaler.step(opt)
        if isinstance(opt, OSS):
            opt.settle()
        scaler.update()

    outcome = catch(step)
    return sees, held, total, outcome


def scaler_task(ctx, rule, clip, sharded):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01,
              partition_rule=rule)  # fmt: skip
    sdp = ShardedDataParallel(model, opt, ctx.group)
    ddp = DDP(ref, process_group=ctx.group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    kind = ShardedGradScaler if sharded else torch.amp.GradScaler
    scaler = kind("cpu", init_scale=2.0**12, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    rows = []
    for step in range(STEPS):
        x = batch(step, ctx.rank)
        factor = float("inf") if step == LOSS_INF and ctx.rank == 0 else 1.0
        poison = step == PARAM_INF and ctx.rank == 0
        before = flat(model)
        sees, held, total, outcome = _iteration(sdp, opt, scaler, x, clip, poison, factor)
        row = {"step": step, "sees": sees, "held": held, "outcome": outcome}
        if outcome[0] != "ok":
            row["untouched"] = torch.equal(before, flat(model))
            rows.append(row)
            break
        _, _, ref_total, ref_outcome = _iteration(ddp, ref_opt, ref_scaler, x, clip, poison, factor)
        assert ref_outcome[0] == "ok", ref_outcome
        row.update(exact=torch.equal(flat(model), flat(ref)), diff=max_diff(model, ref),
                   moved=not torch.equal(before, flat(model)),
                   scales=(scaler.get_scale(), ref_scaler.get_scale()),
                   totals=(total, ref_total))  # fmt: skip
        rows.append(row)
    return rows


def _check(results, world_id, clip, sharded):
    """Every rank: the reference's trajectory until a refusal every rank raised alike."""
    ranks = len(results)
    for step in range(STEPS):
        rows = [r[step] for r in results if len(r) > step]
        if not rows:
            return
        assert len(rows) == ranks, f"step {step}: some ranks stopped earlier"
        outcomes = {row["outcome"] for row in rows}
        if sharded:
            expect = None
        elif clip and any(row["held"] for row in rows):
            expect = PIECES_NOT_UNSCALED  # unscale_() could not reach the pieces
        elif any(row["sees"] for row in rows) and not all(row["sees"] for row in rows):
            expect = SCALES_WOULD_DIFFER.split("{")[0]  # some rank's scaler saw no inf
        elif step == PARAM_INF and ranks > 1:
            expect = SCALES_WOULD_DIFFER.split("{")[0]  # whole params: one owner sees it
        else:
            expect = None
        if expect is not None:
            for kind, message in outcomes:  # on every rank (a peer's names the rank)
                assert kind == "RuntimeError" and expect in message, (step, message)
                assert "oss_plus.ShardedGradScaler" in message
            assert all(row["untouched"] for row in rows), "a refused step changed params"
            return
        assert outcomes == {("ok", None)}, (step, outcomes)
        for row in rows:
            ours, theirs = row["scales"]
            assert ours == theirs, (step, row["scales"])
            if world_id in EXACT and not clip:
                assert row["exact"], (step, row["diff"])
            else:
                assert row["diff"] < 1e-5, (step, row["diff"])
            skipped = step in (LOSS_INF, PARAM_INF)
            assert row["moved"] != skipped, step  # the inf steps skipped, the others stepped
            if clip and not skipped:
                ours, theirs = row["totals"]
                assert torch.allclose(ours, theirs, rtol=1e-5) and theirs > CLIP  # it clipped
    assert len(results[0]) == STEPS


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("world_id", list(WORLDS))
@pytest.mark.parametrize("rule", ["fairscale", "torch", "flat"])
def test_plain_grad_scaler_steps_as_ddp_or_is_refused_on_every_rank(pool, rule, world_id, clip):
    results = pool.run(scaler_task, rule, clip, False, **WORLDS[world_id])
    _check(results, world_id, clip, sharded=False)
    if not clip:  # the inf loss reaches every rank's own .grad at 2 ranks
        steps = len(results[0])
        assert world_id == "ws3" or steps > LOSS_INF + 1, "the agreed skip was not exercised"


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("rule", ["fairscale", "torch", "flat"])
def test_sharded_grad_scaler_steps_as_ddp_under_every_rule(pool, rule, clip):
    results = pool.run(scaler_task, rule, clip, True, world_size=3)
    _check(results, "ws3", clip, sharded=True)
