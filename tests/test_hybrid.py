"""Hybrid sharding (ZeRO-1): OSS sharded within a node group, replicated across node groups.

Everything is compared with an independent reference on the same 4 ranks (2 shard groups x
2 ranks, from :func:`oss_plus.hybrid_groups`): DistributedDataParallel over all 4 ranks and
the plain torch optimizer. The pool has 4 workers; 3 x 2 at 6 ranks is run by hand
(``docs/hybrid.md``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import catch, make_overlap_model, overlap_loss
from test_checkpoint import diff
from torch.nn.parallel import DistributedDataParallel

from oss_plus import OSS, hybrid_groups, load_checkpoint, save_checkpoint
from oss_plus.checkpoint import read_state_dict, storage
from oss_plus.hybrid import GROUPS_DO_NOT_TILE, NO_SHARD_SIZE, _problem

RULES = ["fairscale", "torch", "flat"]


class WithUnused(torch.nn.Module):
    """:func:`make_overlap_model` and a layer the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_overlap_model()
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def pair(ctx, rule, **kw):
    """A hybrid OSS under DDP over the world, and the reference: DDP over the world + Adam."""
    shard, replicate = hybrid_groups(2)
    torch.manual_seed(0)
    model = WithUnused()
    ref = copy.deepcopy(model)
    wrap = dict(process_group=ctx.group, find_unused_parameters=True)
    ddp, ddp_ref = DistributedDataParallel(model, **wrap), DistributedDataParallel(ref, **wrap)
    opt = OSS(
        model.parameters(),
        optim=torch.optim.Adam,
        group=shard,
        replicate_group=replicate,
        partition_rule=rule,
        lr=0.01,
        **kw,
    )
    return ddp, opt, ddp_ref, torch.optim.Adam(ref.parameters(), lr=0.01)


def train_both(ctx, ddp, opt, ddp_ref, plain, steps, clip=None):
    norms = []
    for it in range(steps):
        for model, optimizer in ((ddp, opt), (ddp_ref, plain)):
            optimizer.zero_grad()
            with model.no_sync():  # gradient accumulation: the first micro-batch stays local
                overlap_loss(model, 100 + it, ctx.rank).backward()
            overlap_loss(model, it, ctx.rank).backward()
        if clip is not None:
            norms.append(
                (
                    float(opt.clip_grad_norm(clip)),
                    float(torch.nn.utils.clip_grad_norm_(ddp_ref.parameters(), clip)),
                )
            )
        opt.step()
        plain.step()
    return norms


def exact_task(ctx, rule):
    ddp, opt, ddp_ref, plain = pair(ctx, rule)
    train_both(ctx, ddp, opt, ddp_ref, plain, 3)
    same = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ddp_ref.parameters()))
    return same, diff(opt.state_dict(all_ranks=True), plain.state_dict())


@pytest.mark.parametrize("rule", RULES)
def test_hybrid_zero1_is_bit_identical_to_ddp_and_the_plain_optimizer(pool, rule):
    """fp32, no_sync accumulation, an unused layer; consolidation on every rank."""
    for same, problem in pool.run(exact_task, rule, world_size=4):
        assert same and problem is None, problem


def clip_task(ctx):
    ddp, opt, ddp_ref, plain = pair(ctx, "fairscale")
    norms = train_both(ctx, ddp, opt, ddp_ref, plain, 2, clip=0.05)
    close = all(torch.allclose(a[0], b[0]) for a, b in zip(ddp.parameters(), ddp_ref.parameters()))
    return norms, close


def test_hybrid_clip_counts_every_gradient_once(pool):
    results = pool.run(clip_task, world_size=4)
    for norms, close in results:
        for mine, ref in norms:
            assert mine == pytest.approx(ref, rel=1e-6)  # replicas counted twice: x sqrt(2)
            assert ref > 0.05  # it did clip
        assert close
    assert len({tuple(n) for n, _ in results}) == 1  # the same norm on every rank


# ------------------------------------------------------------------ checkpoints
def save_task(ctx, root, sharded, blocking):
    ddp, opt, ddp_ref, plain = pair(ctx, "torch")
    train_both(ctx, ddp, opt, ddp_ref, plain, 2)
    original, opened = storage.open_writer, []

    def spy(file, header):
        opened.append(file.name)
        return original(file, header)

    storage.open_writer = spy
    try:
        future = save_checkpoint(opt, root, sharded=sharded, blocking=blocking)
        if future is not None:
            future.result(timeout=60)
    finally:
        storage.open_writer = original
    dist.barrier(group=ctx.group)
    # load back at another topology: plain 4-rank sharding, and 1 x 4 hybrid
    expected = plain.state_dict()
    flat = OSS(copy.deepcopy(ddp_ref.module).parameters(), torch.optim.Adam, group=ctx.group)
    load_checkpoint(flat, root)
    shard, replicate = hybrid_groups(1)
    single = OSS(
        copy.deepcopy(ddp_ref.module).parameters(),
        torch.optim.Adam,
        group=shard,
        replicate_group=replicate,
    )
    load_checkpoint(single, root)
    return (
        opened,
        diff(read_state_dict(root), expected),
        diff(flat.state_dict(all_ranks=True), expected),
        diff(single.state_dict(all_ranks=True), expected),
    )


CASES = [(True, True), (False, True), (True, False)]


@pytest.mark.parametrize(
    ("sharded", "blocking"), CASES, ids=["sharded", "consolidated", "sharded-async"]
)
def test_one_replica_set_writes_the_checkpoint_and_any_topology_reads_it(
    pool, tmp_path, sharded, blocking
):
    results = pool.run(save_task, str(tmp_path / "c"), sharded, blocking, world_size=4)
    writers = [len(opened) for opened, *_ in results]
    assert writers == ([1, 1, 0, 0] if sharded else [1, 0, 0, 0])  # replica set 0 only
    for _, *problems in results:
        assert problems == [None, None, None]


# ------------------------------------------------------------------ groups
def mesh_task(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    by_mesh = hybrid_groups(mesh)
    by_size = hybrid_groups(2)
    return [
        (dist.get_process_group_ranks(a), dist.get_process_group_ranks(b))
        for a, b in (by_mesh, by_size)
    ]


def test_hybrid_groups_by_size_and_by_device_mesh(pool):
    expected = {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}
    for rank, (mesh, size) in enumerate(pool.run(mesh_task, world_size=4)):
        assert tuple(mesh) == tuple(size) == expected[rank]


def not_a_member_task(ctx):
    shard, replicate = hybrid_groups(2)
    pair02 = dist.new_group([0, 2])  # on every rank; ranks 1 and 3 are not in it
    params = [torch.nn.Parameter(torch.ones(3))]
    return catch(OSS, params, group=shard, replicate_group=pair02)


def test_a_rank_passing_a_group_it_is_not_in_raises_on_every_rank(pool):
    for kind, message in pool.run(not_a_member_task, world_size=4):
        assert kind == "ValueError"
        assert "rank 1 is not a member of its replicate group" in message


def bad_groups_task(ctx):
    shard, replicate = hybrid_groups(2)
    pair01, pair23 = ctx.groups.get((0, 1)), ctx.groups.get((2, 3))
    node = pair01 if ctx.global_rank < 2 else pair23
    params = [torch.nn.Parameter(torch.ones(3))]
    return [
        catch(OSS, params, group=shard, replicate_group=node),  # replicas = the shard group
        catch(OSS, params, group=shard, replicate_group=ctx.group),  # 2 x 4 != 4
        catch(hybrid_groups, 3),  # does not divide 4
        catch(OSS, params, group=shard, replicate_group=replicate),  # fine
    ]


def test_groups_that_do_not_tile_the_world_raise_on_every_rank(pool):
    for same_as_shard, too_many, bad_size, fine in pool.run(bad_groups_task, world_size=4):
        assert same_as_shard[0] == "ValueError" and "hold different shards" in same_as_shard[1]
        assert too_many[0] == "ValueError" and "2 x 4 != 4" in too_many[1]
        assert bad_size[0] == "ValueError" and "divides the world size" in bad_size[1]
        assert fine[0] == "ok"
    assert "hybrid_groups(shard_size" in NO_SHARD_SIZE and "tile" in GROUPS_DO_NOT_TILE


def test_a_rank_in_no_group_is_named():
    rows = [[2, 0, 0, 2, 0, 0], [2, 1, 0, 2, 0, 1], [2, 0, 2, 2, 1, 0], [2, 1, 2, 0, -1, -1]]
    assert _problem(rows, 4) == "rank 3 is not a member of its replicate group"
    good = [[2, 0, 0, 2, 0, 0], [2, 1, 0, 2, 0, 1], [2, 0, 2, 2, 1, 0], [2, 1, 2, 2, 1, 1]]
    assert _problem(good, 4) is None


def failing_save_task(ctx, root, blocking=True):
    import errno

    ddp, opt, ddp_ref, plain = pair(ctx, "fairscale")
    train_both(ctx, ddp, opt, ddp_ref, plain, 1)
    save_checkpoint(opt, root)
    before = read_state_dict(root)
    train_both(ctx, ddp, opt, ddp_ref, plain, 1)
    original = storage.open_writer

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    if ctx.global_rank == 1:  # a writer (replica set 0), not its group's coordinator
        storage.open_writer = disk_full
    try:
        outcome = catch(save_checkpoint, opt, root, blocking=blocking)
        if not blocking:  # the future's exception, on every rank
            error = outcome[1].exception(timeout=60)
            outcome = (type(error).__name__, str(error)) if error else ("ok", None)
    finally:
        storage.open_writer = original
    return outcome, diff(read_state_dict(root), before)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_failed_hybrid_save_raises_on_every_replica_set(pool, tmp_path, blocking):
    for rank, (outcome, problem) in enumerate(
        pool.run(failing_save_task, str(tmp_path / "c"), blocking, world_size=4)
    ):
        assert outcome[0] == "OSError" and "(injected)" in outcome[1], (rank, outcome)
        assert problem is None  # the previous checkpoint is whole


def bf16_wire_task(ctx, rule):
    """ZeRO-1 hybrid with the params sent as bf16, against DDP over the world and an
    independent reference of fp32 main params: Adam steps the main params with the
    gradients of a model holding them rounded to bf16 (as tests/test_compression.py)."""
    shard, replicate = hybrid_groups(2)
    torch.manual_seed(0)
    model = WithUnused()
    ref = copy.deepcopy(model)
    main = [torch.nn.Parameter(p.detach().clone()) for p in ref.parameters()]
    wrap = dict(process_group=ctx.group, find_unused_parameters=True)
    ddp, ddp_ref = DistributedDataParallel(model, **wrap), DistributedDataParallel(ref, **wrap)
    opt = OSS(
        model.parameters(),
        optim=torch.optim.Adam,
        group=shard,
        replicate_group=replicate,
        partition_rule=rule,
        broadcast_dtype=torch.bfloat16,
        lr=0.01,
    )
    plain = torch.optim.Adam(main, lr=0.01)
    same = []
    for it in range(3):
        for net in (ddp, ddp_ref):
            net.zero_grad()
            overlap_loss(net, it, ctx.rank).backward()
        opt.step()
        for m, p in zip(main, ref.parameters()):
            m.grad = p.grad
        plain.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), main):
                p.copy_(m.to(torch.bfloat16))
        same.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())))
    return same


@pytest.mark.parametrize("rule", RULES)
def test_hybrid_zero1_bf16_wire_equals_the_rounded_main_params(pool, rule):
    for same in pool.run(bf16_wire_task, rule, world_size=4):
        assert same == [True] * 3
