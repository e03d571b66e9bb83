"""Which layout and transport a :class:`~oss_plus.planning.plan.ShardPolicy` asks for: the
factory the core calls (:func:`build_sync`) to lay out the params of a shard plan and get the
:class:`~oss_plus.wire.sync.BucketSync` that moves their bytes.

The layouts themselves are :mod:`oss_plus.wire.layout` (``owner_buckets``, ``ordered_buckets``,
``per_param``, ``flat_buckets``), the transports :mod:`oss_plus.wire.transport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from oss_plus.planning.partition import Rule
from oss_plus.planning.plan import Layout, ShardPlan, ShardPolicy
from oss_plus.wire.layout import flat_buckets, ordered_buckets, owner_buckets, per_param
from oss_plus.wire.sync import BucketSync
from oss_plus.wire.transport import TRANSPORT_ENV, gathered_keys, requested

__all__ = ["TRANSPORT_ENV", "build_sync"]


def build_sync(
    params: Sequence[torch.Tensor], plan: ShardPlan, policy: ShardPolicy, group: Any
) -> BucketSync:
    """Lay out ``params`` (flat order) owned as in ``plan`` by ``policy.layout``; return the
    transport over that layout.

    At world size 1 nothing travels: no layout (params keep their own storage) unless
    ``policy.single_rank_layout``.

    Raises:
        ValueError: unknown ``policy.transport`` (or value of :data:`TRANSPORT_ENV`).
    """
    if plan.world_size == 1 and not policy.single_rank_layout:
        requested(policy.transport)
        return BucketSync([], group)
    if plan.rule is Rule.FLAT:
        keys = gathered_keys([params], policy.transport, group, equal_regions=True)
        buckets, gathers = flat_buckets(params, plan.world_size, policy.aligned, keys)
        return BucketSync(buckets, group, gathers)
    if policy.layout is Layout.OWNER_BUCKETS:
        by_owner = [[params[i] for i in plan.owned(r)] for r in range(plan.world_size)]
        keys = gathered_keys(by_owner, policy.transport, group, policy.aligned)
        buckets, gathers = owner_buckets(by_owner, policy.aligned, keys)
        return BucketSync(buckets, group, gathers)
    requested(policy.transport)
    by_local = [
        [params[i] for indices in plan.local_indices(r) for i in indices]
        for r in range(plan.world_size)
    ]
    if policy.layout is Layout.ORDERED_BUCKETS:
        return BucketSync(ordered_buckets(by_local), group)
    return BucketSync(per_param(by_local), group)
