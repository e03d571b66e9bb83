"""ZeRO-2 buckets sized like DDP's (issue 38, item 4).

References, none of them oss_plus's own bookkeeping: torch's own bucket assignment
(``dist._compute_bucket_assignment_by_size``, what DDP's reducer runs), the collectives a
DDP backward launches (counted by a comm hook) and the ``reduce`` / ``reduce_scatter_tensor``
calls a ZeRO-2 backward makes (counted on ``torch.distributed``).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel
from oss_plus.data_parallel._validate import TWO_BUCKET_SIZES
from oss_plus.data_parallel.plan import BucketCap, GradSpec, plan_buckets

MiB = 2**20


# ----------------------------------------------------------------- pure: torch's assignment
def _torch_buckets(numels: list[int], order: list[int], cap_bytes: int) -> list[set[int]]:
    """DDP's buckets (fp32) of the tensors taken in ``order``, one size limit."""
    ordered = [torch.empty(numels[i]) for i in order]
    buckets, _ = dist._compute_bucket_assignment_by_size(ordered, [cap_bytes], [False] * len(order))
    return [{order[k] for k in b} for b in buckets]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap_elements", [0, 1, 100, 1000])
def test_one_owner_buckets_are_ddps(seed, cap_elements):
    """With one owner and one dtype, the buckets are exactly DDP's, param for param."""
    rng = random.Random(seed)
    numels = [rng.choice([1, 7, 64, 300, 2000]) for _ in range(30)]
    specs = [GradSpec(n, 0, "f32") for n in numels]
    order = list(reversed(range(len(numels))))
    plan = plan_buckets(specs, BucketCap(4 * cap_elements, in_bytes=True))
    ours = [set(b.members) for b in plan.buckets]
    assert ours == _torch_buckets(numels, order, 4 * cap_elements)


@pytest.mark.parametrize("seed", range(4))
def test_each_owners_buckets_are_ddps_over_its_params(seed):
    """Several owners: each owner's buckets are DDP's buckets over that owner's params (in
    backward order), so their number is DDP's over that share."""
    rng = random.Random(seed)
    numels = [rng.choice([5, 64, 500]) for _ in range(40)]
    owners = [rng.randrange(3) for _ in numels]
    specs = [GradSpec(n, o, "f32") for n, o in zip(numels, owners)]
    plan = plan_buckets(specs, BucketCap(4 * 700, in_bytes=True))
    order = list(reversed(range(len(numels))))
    for owner in range(3):
        mine = [i for i in order if owners[i] == owner]
        expected = _torch_buckets(numels, mine, 4 * 700) if mine else []
        assert [set(b.members) for b in plan.buckets if b.owner == owner] == expected


def test_reduce_buffer_size_keeps_fairscales_meaning():
    """An int cap: a bucket closes before it would exceed that many elements."""
    specs = [GradSpec(n, 0, "f32") for n in (6, 5, 4, 3)]
    plan = plan_buckets(specs, 9)  # backward order: 3, 4 | 5 | 6
    assert [b.numel for b in plan.buckets] == [7, 5, 6]
    assert all(b.numel <= 9 or len(b.members) == 1 for b in plan.buckets)
    assert [b.numel for b in plan_buckets(specs, BucketCap(36, in_bytes=True)).buckets] == [12, 6]


@pytest.mark.parametrize("bad", [-1, "25"])
def test_bad_caps_raise_naming_the_fix(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number >= 0, got"):
        BucketCap.megabytes(bad)
    with pytest.raises(ValueError, match="bucket cap must be a number >= 0"):
        BucketCap(bad)


# ----------------------------------------------------------------- counted on the wire
def _wide(width: int, layers: int, act: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
        blocks += [torch.nn.Tanh()] if act else []
    return torch.nn.Sequential(*blocks)


def _ddp_collectives(model: torch.nn.Module, ctx, x: torch.Tensor, cap_mb: float | None) -> int:
    """All-reduces of DDP's second backward (after its bucket rebuild), by a comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ddp = DDP(model, process_group=ctx.group, **kwargs)
    seen = [0]

    def hook(state, bucket):  # noqa: ANN001, ANN202
        seen[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(ctx.group, hook)
    ddp(x).pow(2).mean().backward()
    seen[0] = 0
    ddp(x).pow(2).mean().backward()
    return seen[0]


class _Launched:
    """Counts every collective a ZeRO-2 backward launches on ``torch.distributed``."""

    NAMES = ("reduce", "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather")

    def __enter__(self) -> dict[str, int]:
        self.calls: dict[str, int] = {}
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for name, fn in self.saved.items():

            def counted(*args, _name=name, _fn=fn, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self.calls

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def count_task(ctx, width, layers, act, collective, cap_mb, rule="fairscale"):
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(ctx.rank))
    model = _wide(width, layers, act)
    ddp = _ddp_collectives(copy.deepcopy(model), ctx, x, cap_mb)
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    opt = OSS(
        model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, partition_rule=rule
    )
    sdp = ShardedDataParallel(model, opt, ctx.group, collective=collective, **kwargs)
    sdp(x).pow(2).mean().backward()  # the first backward records the order
    sdp.zero_grad()
    loss = sdp(x).pow(2).mean()
    with _Launched() as calls:
        loss.backward()
    return {"ddp": ddp, "zero2": calls}


def _total(calls: dict[str, int]) -> int:
    return sum(calls.values())


@pytest.mark.parametrize(
    ("collective", "rule"),
    [("reduce", "fairscale"), ("reduce_scatter", "fairscale"), ("reduce", "flat")],
)
def test_wide_model_launches_no_more_than_ddp(pool, collective, rule):
    """24 x (Linear(2048) + LayerNorm) at DDP's default 25 MiB: DDP all-reduces 13 buckets;
    ZeRO-2 used to launch 24 reduces (fairscale's 2**23-element cap closed every bucket
    after one weight; the flat rule's slices too). A flat key's slice travels alone, by
    ``reduce``, whatever the collective."""
    args = (2048, 24, False, collective, None, rule)
    results = pool.run(count_task, *args, world_size=2, timeout=240)
    for r in results:
        assert r["ddp"] == 13, r
        assert 0 < _total(r["zero2"]) <= r["ddp"], r
        assert set(r["zero2"]) <= {"reduce", "reduce_scatter_tensor"}, r


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("cap_mb", [None, 0.5])
def test_cpu_proxy_launches_no_more_than_ddp(pool, world, cap_mb):
    """The bench's CPU proxy, 96 x (Linear(64) + LayerNorm + Tanh), with ``reduce_scatter``
    (buckets of distinct owners in one collective) at any world size, and with ``reduce``
    at 2 ranks (one collective per owner at least: W reduces where DDP sends 2)."""
    results = pool.run(count_task, 64, 96, True, "reduce_scatter", cap_mb, world_size=world)
    for r in results:
        assert 0 < _total(r["zero2"]) <= r["ddp"], r
    if world == 2:  # a flat key's slices travel by reduce, one per slice
        for r in pool.run(count_task, 64, 96, True, "reduce", cap_mb, "flat", world_size=2):
            assert 0 < _total(r["zero2"]) <= r["ddp"], r
    if world == 2:
        for r in pool.run(count_task, 64, 96, True, "reduce", cap_mb, world_size=2):
            assert 0 < _total(r["zero2"]) <= r["ddp"], r


def both_task(ctx):
    model = torch.nn.Linear(4, 4)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    try:
        ShardedDataParallel(model, opt, ctx.group, reduce_buffer_size=64, bucket_cap_mb=1.0)
    except ValueError as exc:
        return str(exc)
    return None


def test_both_sizes_raise_on_every_rank(pool):
    expected = TWO_BUCKET_SIZES.format(elements=64, mb=1.0)
    assert pool.run(both_task, world_size=2) == [expected, expected]
