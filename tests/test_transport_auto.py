"""``transport="auto"`` picks per key by the bytes it would move (issue 38, item 3).

The bytes are counted at the ``torch.distributed`` calls of one step (``wire_traffic``) and
compared with closed-form arithmetic from the params' sizes and owners: per key, the
per-owner broadcasts carry every owner's aligned params plus one status slot; an
``all_gather`` carries ``W`` regions of the largest share plus its slot, rounded up to the
alignment. On gloo ``auto`` broadcasts; NCCL's rule is run on gloo by declaring gloo one of
:data:`oss_plus.wire.transport.GATHER_BACKENDS` inside the worker.
"""

from __future__ import annotations

import pytest
import torch
from helpers import wire_traffic

from oss_plus import OSS
from oss_plus.wire import transport as transport_module
from oss_plus.wire.transport import auto_gathers, owner_key_elements

#: fp64: four equal tensors (fairscale's rule, given first: an equal share on 2 and 4 ranks);
#: fp32: one tensor dominates (an embedding).
SIZES = {torch.float64: (20_000,) * 4, torch.float32: (600_000, 16, 16, 16)}
ALIGN = {torch.float32: 16, torch.float64: 8}  # 64 bytes on the CPU


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


def expected_bytes(shares: list[int], dtype: torch.dtype, world: int) -> tuple[int, int]:
    """(broadcast, all_gather) bytes of one key, from each owner's aligned share."""
    size = dtype.itemsize
    broadcast = sum((s + 1) * size for s in shares if s)
    gather = world * _up(max(shares) + 1, ALIGN[dtype]) * size
    return broadcast, gather


def auto_task(ctx, nccl_rule):
    saved = transport_module.GATHER_BACKENDS
    if nccl_rule:
        transport_module.GATHER_BACKENDS = ("nccl", "gloo")
    try:
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.ones(n, dtype=dtype))
            for dtype, ns in SIZES.items()
            for n in ns
        ]
        opt = OSS(
            params, optim=torch.optim.SGD, group=ctx.group, lr=0.1, partition_rule="fairscale"
        )
    finally:
        transport_module.GATHER_BACKENDS = saved
    for p in params:
        p.grad = torch.ones_like(p)
    with wire_traffic() as seen:
        opt.step()
    world = ctx.world_size
    result = {}
    for dtype in SIZES:
        shares = [0] * world
        for p in params:
            if p.dtype == dtype:
                shares[opt.param_to_rank[p]] += _up(p.numel(), ALIGN[dtype])
        calls = [(kind, nbytes) for kind, d, nbytes in seen if d == dtype]
        result[str(dtype)] = {"calls": calls, "expected": expected_bytes(shares, dtype, world)}
    result["via"] = opt.sync_buckets.transports()
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_rule_gathers_only_where_it_moves_no_more(pool, world):
    results = pool.run(auto_task, True, world_size=world)
    assert all(r["via"] == results[0]["via"] for r in results)  # the same choice everywhere
    for r in results:
        big = r["torch.float32"]
        broadcast, gather = big["expected"]
        assert gather > broadcast + (world - 1) * 2**19  # W x the embedding's share
        assert {kind for kind, _ in big["calls"]} == {"broadcast"}
        assert sum(n for _, n in big["calls"]) == broadcast  # the total, not W x the largest
        even = r["torch.float64"]
        broadcast, gather = even["expected"]
        assert even["calls"] == [("all_gather", gather)]  # one collective for the key


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_broadcasts_every_key(pool, world):
    for r in pool.run(auto_task, False, world_size=world):
        for dtype in ("torch.float32", "torch.float64"):
            broadcast, _ = r[dtype]["expected"]
            assert {kind for kind, _ in r[dtype]["calls"]} == {"broadcast"}
            assert sum(n for _, n in r[dtype]["calls"]) == broadcast


def test_rule_on_the_projection_of_docs_performance():
    """1.3B fp32 params with an 80M-element embedding at 64 ranks (docs/performance.md): an
    all_gather would carry 64 x 80M x 4 B = 20.5 GB, the broadcasts 5.2 GB."""
    shares = [80_000_000] + [(1_300_000_000 - 80_000_000) // 63] * 63
    broadcast, gather = owner_key_elements(shares, align=128, world=64)
    assert 4 * gather > 20.4e9 and 5.19e9 < 4 * broadcast < 5.21e9
    assert not auto_gathers(4 * broadcast, 4 * gather, world=64)
    even = [1_300_000_000 // 64] * 64  # the flat rule's equal shares
    assert auto_gathers(*(4 * x for x in owner_key_elements(even, align=128, world=64)), 64)
