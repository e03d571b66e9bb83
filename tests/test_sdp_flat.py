"""ShardedDataParallel with the flat partition rule against DDP + the unsharded optimizer.

A param the flat rule splits is reduced piece by piece: each rank holding a piece ends the
backward with the sum over its range only, handed to its optimizer (``set_piece_grad``);
no rank keeps the param's ``.grad``. Bit-identical where the sum can be (1-2 ranks, the
offset pair), within the summation order bound on 3-4 ranks (see tests/test_sdp.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import WORLD_IDS, WORLDS, make_cut_model
from sdp_utils import Net, batch, flat, max_diff, same_everywhere
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel

EXACT = {"ws1", "ws2", "offset23"}


def _grads_as_expected(ctx, sdp, opt, ddp):
    """Per param: the owner of a whole param holds DDP's gradient as ``.grad``; of a split
    param no rank holds a ``.grad``, and each piece holder was handed DDP's gradient over
    its range (``opt.piece_grads()``); every other rank holds nothing."""
    ok, exact, diff = True, True, 0.0
    given = opt.piece_grads()
    for i, (p, q) in enumerate(zip(sdp.module.parameters(), ddp.module.parameters())):
        piece = opt.plan.piece(ctx.rank, i)
        if i in opt.plan.split:
            ok &= p.grad is None
            got = given.get(i)
            if piece is None or q.grad is None:
                ok &= got is None
                continue
            want = q.grad.reshape(-1)[piece.start : piece.end]
        else:
            ok &= i not in given
            got = p.grad
            if piece is None or q.grad is None:
                ok &= got is None
                continue
            want = q.grad
        if got is None:
            ok = False
            continue
        exact &= torch.equal(got, want)
        diff = max(diff, float((got - want).abs().max()))
    return {"ok": ok, "exact": exact, "diff": diff}


def _bf16_hook(group, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, group, bucket)


def flat_task(
    ctx,
    bucket,
    collective,
    branch=False,
    accumulate=0,
    steps=3,
    bf16=False,
    freeze_at=None,
    cut=False,
):
    torch.manual_seed(0)
    model = make_cut_model() if cut else Net(branch=branch)  # cut: ranges with slots
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01,
              partition_rule="flat")  # fmt: skip
    wire = {"reduce_dtype": torch.bfloat16} if bf16 else {}
    sdp = ShardedDataParallel(
        model, opt, ctx.group, reduce_buffer_size=bucket, collective=collective, **wire
    )
    unused = branch or freeze_at is not None
    ddp = DDP(ref, process_group=ctx.group, find_unused_parameters=unused)
    if bf16:  # bf16_compress_hook itself is refused off CUDA; this is its body
        ddp.register_comm_hook(ctx.group, _bf16_hook)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    checks = []
    for step in range(steps):
        if freeze_at is not None:  # fc1 frozen for two steps: the cut moves twice
            for m in (sdp.module, ddp.module):
                m.fc1.weight.requires_grad_(not freeze_at <= step < freeze_at + 2)
        use_branch = {} if cut else {"use_branch": branch and (step + ctx.rank) % 2 == 0}
        for net, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            width = 6 if cut else 8
            for micro in range(accumulate):
                with net.no_sync():
                    net(batch(100 + micro, ctx.rank, width)).pow(2).mean().backward()
            net(batch(step, ctx.rank, width), **use_branch).pow(2).mean().backward()
        checks.append(_grads_as_expected(ctx, sdp, opt, ddp))
        opt.step()
        ref_opt.step()
    return {
        "checks": checks,
        "split": len(opt.plan.split),
        "slotted": opt.sync.status.vector is None,
        "exact": torch.equal(flat(sdp.module), flat(ddp.module)),
        "diff": max_diff(sdp.module, ddp.module),
        "replicas": same_everywhere(ctx, flat(sdp.module)),
    }


def _assert(results, world_id):
    if len(results) > 1:
        assert results[0]["split"] > 0, "the model must be cut inside params"
    for rank, r in enumerate(results):
        assert all(c["ok"] for c in r["checks"]), f"rank {rank} holds the wrong gradients"
        assert r["replicas"]
        if world_id in EXACT:
            assert all(c["exact"] for c in r["checks"]), r["checks"]
            assert r["exact"], r["diff"]
        else:
            assert r["diff"] < 1e-5 and all(c["diff"] < 1e-6 for c in r["checks"])


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("bucket", [0, 2**23])
def test_flat_rule_matches_ddp_and_the_unsharded_optimizer(pool, world, bucket, collective):
    world_id = WORLD_IDS[WORLDS.index(world)]
    _assert(pool.run(flat_task, bucket, collective, **world), world_id)


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[2]], ids=["ws2", "ws3"])
def test_flat_rule_with_ranges_that_carry_slots_matches_ddp(pool, world, collective):
    """A param cut by a range boundary keeps a copy of its own (the ranges carry slots)."""
    results = pool.run(flat_task, 2**23, collective, accumulate=1, cut=True, **world)
    assert all(r["slotted"] for r in results)
    _assert(results, WORLD_IDS[WORLDS.index(world)])


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3]], ids=["ws2", "ws4"])
def test_flat_rule_with_unused_params_and_no_sync(pool, world):
    world_id = WORLD_IDS[WORLDS.index(world)]
    _assert(pool.run(flat_task, 200, "reduce", branch=True, accumulate=2, **world), world_id)


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_flat_rule_with_a_bf16_reduction_matches_ddps_compress_hook(pool, collective):
    _assert(pool.run(flat_task, 2**23, collective, bf16=True, world_size=2), "ws2")


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_flat_rule_follows_freezing_and_unfreezing(pool, world):
    world_id = WORLD_IDS[WORLDS.index(world)]
    _assert(pool.run(flat_task, 2**23, "reduce", freeze_at=1, steps=5, **world), world_id)


def amp_task(ctx, inf_step=2):
    """ShardedGradScaler over SDP + the flat rule against torch's GradScaler over DDP + plain
    Adam: the piece gradients handed over are unscaled and checked like .grad; an inf on
    one rank at ``inf_step`` makes every rank skip."""
    from oss_plus import ShardedGradScaler

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01,
              partition_rule="flat")  # fmt: skip
    sdp = ShardedDataParallel(model, opt, ctx.group)
    ddp = DDP(ref, process_group=ctx.group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**12)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    exact = []
    for step in range(4):
        x = batch(step, ctx.rank)
        if step == inf_step and ctx.rank == 0:
            x[0, 0] = float("inf")
        for net, o, s in ((sdp, opt, scaler), (ddp, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(net(x).pow(2).mean()).backward()
            s.step(o)
            s.update()
        exact.append(torch.equal(flat(sdp.module), flat(ddp.module)))
    return {"exact": exact, "scales": (scaler.get_scale(), ref_scaler.get_scale()),
            "split": len(opt.plan.split), "left": len(opt.piece_grads())}  # fmt: skip


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_sharded_grad_scaler_unscales_the_piece_gradients(pool, world):
    for r in pool.run(amp_task, **world):
        assert r["split"] > 0 and r["left"] == 0
        assert all(r["exact"]), r["exact"]
        assert r["scales"][0] == r["scales"][1] < 2.0**12  # the inf step was skipped


def piece_grad_task(ctx):
    torch.manual_seed(0)
    model = Net()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1,
              partition_rule="flat")  # fmt: skip
    index = min(opt.plan.split)
    piece = opt.plan.piece(ctx.rank, index)
    errors = []
    for grad in (torch.zeros(3), torch.zeros(piece.numel, dtype=torch.float64)):
        try:
            opt.set_piece_grad(index, grad)
        except ValueError as exc:
            errors.append(str(exc))
    whole = next(i for i in range(opt.plan.num_params) if i not in opt.plan.split)
    try:
        opt.set_piece_grad(whole, torch.zeros(1))
    except ValueError as exc:
        errors.append(str(exc))
    opt.set_piece_grad(index, torch.ones(piece.numel))
    kept = len(opt.piece_grads())
    opt.zero_grad()
    return {"errors": errors, "kept": kept, "after_zero_grad": len(opt.piece_grads())}


def test_set_piece_grad_checks_its_input_and_zero_grad_drops_it(pool):
    for r in pool.run(piece_grad_task, world_size=2):
        assert len(r["errors"]) == 3
        assert "must be a torch.float32 tensor of shape" in r["errors"][0]
        assert "got torch.float64" in r["errors"][1]
        assert "is not split with a piece on rank" in r["errors"][2]
        assert r["kept"] == 1 and r["after_zero_grad"] == 0
