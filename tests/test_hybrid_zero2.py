"""Hybrid ZeRO-2: ShardedDataParallel reducing within a shard group, then across replicas.

The reference is DistributedDataParallel over all 4 ranks (2 shard groups x 2 ranks) + the
plain torch optimizer; the bytes each rank sends on each group are counted at the
``torch.distributed`` call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from sdp_utils import Net, abs_sum, batch, flat, same_everywhere
from test_sdp import _bf16_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel, hybrid_groups
from oss_plus.data_parallel._validate import OTHER_REPLICAS


def build(ctx, rule, wire=None, collective="reduce", bucket=64):
    shard, replicate = hybrid_groups(2)
    torch.manual_seed(0)
    model = Net(branch=True)
    ref = copy.deepcopy(model)
    opt = OSS(
        model.parameters(),
        optim=torch.optim.Adam,
        group=shard,
        replicate_group=replicate,
        partition_rule=rule,
        lr=0.01,
    )
    sdp = ShardedDataParallel(
        model, opt, reduce_buffer_size=bucket, reduce_dtype=wire, collective=collective
    )
    ddp = DDP(ref, process_group=ctx.group, find_unused_parameters=True)
    if wire is not None:
        ddp.register_comm_hook(ctx.group, _bf16_hook)
    return sdp, opt, ddp, torch.optim.Adam(ref.parameters(), lr=0.01)


def _loss(step, rank, use_branch):
    """The two micro-batches' loss (their gradients are what each rank accumulates)."""

    def loss(m):
        first = m(batch(100 + step, rank)).pow(2).mean()
        return first + m(batch(step, rank), use_branch=use_branch).pow(2).mean()

    return loss


def parity_task(ctx, rule, wire, collective):
    sdp, opt, ddp, plain = build(ctx, rule, wire, collective)
    eps = torch.finfo(wire or torch.float32).eps
    checks = []
    for step in range(3):
        use_branch = (step + ctx.rank) % 2 == 0  # used on some ranks only; `never`: on none
        sums = abs_sum(ctx, sdp.module, _loss(step, ctx.rank, use_branch)) if step == 0 else None
        for net, o in ((sdp, opt), (ddp, plain)):
            o.zero_grad()
            with net.no_sync():  # accumulation: the first micro-batch stays local
                net(batch(100 + step, ctx.rank)).pow(2).mean().backward()
            net(batch(step, ctx.rank), use_branch=use_branch).pow(2).mean().backward()
        sharded, within = True, True
        params = zip(sdp.module.parameters(), ddp.module.parameters(), sums or [None] * 99)
        for k, (p, q, s) in enumerate(params):
            # a param the flat rule cuts: its pieces go to the optimizer, .grad to nobody
            owns = opt.param_to_rank[p] == opt.rank and k not in opt.plan.split
            sharded &= (p.grad is not None) == (owns and q.grad is not None)
            if s is not None and p.grad is not None and q.grad is not None:
                bound = 1.1 * (ctx.world_size - 1) * eps * s
                within &= bool(((p.grad - q.grad).abs() <= bound).all())
        checks.append((sharded, within))
        opt.step()
        plain.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(flat(sdp.module), flat(ddp.module)))
    return checks, diff, same_everywhere(ctx, flat(sdp.module))


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("rule", ["fairscale", "torch", "flat"])
def test_hybrid_zero2_matches_ddp_over_the_world(pool, rule, collective):
    """fp32; no_sync accumulation; a branch unused on some ranks, a layer unused on all."""
    for checks, diff, replicas in pool.run(parity_task, rule, None, collective, world_size=4):
        assert all(sharded for sharded, _ in checks)  # grads on their owners only
        assert checks[0][1]  # within the summation-order bound of DDP's at the first step
        assert diff < 1e-5 and replicas  # every rank of every replica set identical


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_hybrid_zero2_bf16_wire_matches_ddp_bf16_hook(pool, collective):
    results = pool.run(parity_task, "fairscale", torch.bfloat16, collective, world_size=4)
    for checks, diff, replicas in results:
        assert all(sharded for sharded, _ in checks) and checks[0][1]
        assert diff < 1e-2 and replicas


# ------------------------------------------------------------------ bytes per group
class Counted:
    """Bytes handed to reduce / reduce_scatter_tensor / all_reduce, per group (its ranks)."""

    NAMES = ("reduce", "reduce_scatter_tensor", "all_reduce")

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, tuple[int, ...]], int] = {}
        self._saved: dict[str, object] = {}

    def __enter__(self) -> Counted:
        for name in self.NAMES:
            original = self._saved[name] = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):  # noqa: ANN002, ANN003, ANN202
                tensor = args[1] if _name == "reduce_scatter_tensor" else args[0]
                ranks = tuple(dist.get_process_group_ranks(kwargs["group"]))
                key = (_name, ranks)
                self.bytes[key] = self.bytes.get(key, 0) + tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def bytes_task(ctx, collective):
    sdp, opt, _, _ = build(ctx, "fairscale", collective=collective, bucket=2**23)
    sdp(batch(0, ctx.rank)).pow(2).mean().backward()  # records the order
    opt.step()
    opt.zero_grad()
    with Counted() as wire:
        sdp(batch(1, ctx.rank)).pow(2).mean().backward()
    owned = [p for p in sdp.module.parameters() if opt.param_to_rank[p] == opt.rank]
    mine = sum(p.numel() + 1 for p in owned) * 4  # fp32 grads + one "used" flag each
    total = sum(p.numel() + 1 for p in sdp.module.parameters()) * 4
    return {str(k): v for k, v in wire.bytes.items()}, mine, total


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_across_replicas_each_rank_sends_only_what_it_owns(pool, collective):
    results = pool.run(bytes_task, collective, world_size=4)
    shard_groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    replicas = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    across = []
    for rank, (seen, mine, total) in enumerate(results):
        assert set(seen) == {
            str(
                (
                    collective + ("_tensor" if collective == "reduce_scatter" else ""),
                    shard_groups[rank],
                )
            ),
            str(("all_reduce", replicas[rank])),
        }  # nothing over the world
        across.append(seen[str(("all_reduce", replicas[rank]))])
        assert across[-1] == mine < total  # the owned 1/S, not every gradient
    assert across[0] + across[1] == results[0][2]  # the shard group's owners cover it all


# ------------------------------------------------------------------ groups
def mismatch_task(ctx):
    shard, replicate = hybrid_groups(2)
    model = Net()
    opt = OSS(model.parameters(), group=shard, replicate_group=replicate, lr=0.1)
    plain = OSS(model.parameters(), group=shard, lr=0.1)
    from helpers import catch

    return (
        catch(ShardedDataParallel, model, opt, shard, replicate_group=ctx.group),
        catch(ShardedDataParallel, model, plain, shard, replicate_group=replicate),
    )


def test_mismatched_replicate_groups_raise_on_every_rank(pool):
    for wrong, missing in pool.run(mismatch_task, world_size=4):
        for kind, message in (wrong, missing):
            assert kind == "ValueError" and "replicate_group" in message, message
    assert "replicate_group" in OTHER_REPLICAS


# ------------------------------------------------------------------ scaler and clip
def scaler_task(ctx):
    """ShardedGradScaler + clip_grad_norm under hybrid ZeRO-2 against DDP + GradScaler +
    torch's clip; an overflow in global rank 3's backward at step 1 (reduced into every
    replica's sums: a skipped step everywhere)."""
    from oss_plus import ShardedGradScaler

    sdp, opt, ddp, plain = build(ctx, "fairscale")
    scalers = [
        ShardedGradScaler("cpu", init_scale=2.0**12),
        torch.amp.GradScaler("cpu", init_scale=2.0**12),
    ]
    out = []
    for step in range(3):
        row = []
        for (net, o), scaler in zip(((sdp, opt), (ddp, plain)), scalers):
            o.zero_grad()
            loss = net(batch(step, ctx.rank)).pow(2).mean()
            if step == 1 and ctx.global_rank == 3:  # an overflow in one rank's backward
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(o)
            norm = (
                o.clip_grad_norm(0.05)
                if o is opt
                else torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            )
            scaler.step(o)
            scaler.update()
            row.append((float(norm), scaler.get_scale()))
        out.append(row)
    diff = max(float((a - b).abs().max()) for a, b in zip(flat(sdp.module), flat(ddp.module)))
    return out, diff, same_everywhere(ctx, flat(sdp.module))


def test_hybrid_zero2_scaler_and_clip_match_ddp(pool):
    for rows, diff, replicas in pool.run(scaler_task, world_size=4):
        for step, ((norm, scale), (ref_norm, ref_scale)) in enumerate(rows):
            assert scale == ref_scale  # the same steps skipped (step 1, on every rank)
            if step != 1:
                assert norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > 0.05
        assert rows[1][0][1] == 2.0**11  # backed off
        assert diff < 1e-5 and replicas


def host_reads_task(ctx, collective):
    from sdp_utils import HostReads

    sdp, opt, _, _ = build(ctx, "fairscale", collective=collective)
    counts = []
    for step in range(3):  # the branch used on every rank; the `never` layer on none
        opt.zero_grad()
        with HostReads() as reads:
            sdp(batch(step, ctx.rank), use_branch=True).pow(2).mean().backward()
        counts.append(len(reads.reads))
        opt.step()
    with HostReads() as control:
        torch.ones(2).sum().item()
    return counts, len(control.reads)


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_hybrid_backward_reads_nothing_on_the_host_but_unused_flags(pool, collective):
    """The replica all-reduces add no host read: at the third forward + backward (the second
    adopts the recorded bucket order: one read) the only value read is the summed used
    flags of the layer no rank uses, on its owner, as without hybrid sharding."""
    for counts, control in pool.run(host_reads_task, collective, world_size=4):
        assert control == 1  # the counter is not blind
        assert counts[2] <= 1, counts
