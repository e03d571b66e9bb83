"""Input checks of :class:`~oss_plus.data_parallel.ShardedDataParallel` and their messages.

Pure apart from reading process-group membership: every rank computes the same answer from
the same model and optimizers; the wrapper then raises on every rank together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.data_parallel.flat import cut_param, key_layout
from oss_plus.data_parallel.plan import DDP_BUCKET_CAP_MB, BucketCap, FlatKey
from oss_plus.optimizer import OSS
from oss_plus.planning.partition import Rule
from oss_plus.wire.layout import alignment

__all__ = [
    "FLAT_LAYOUT",
    "MISSING_PARAMS",
    "MIXED_DEVICE_TYPES",
    "MODULE_MOVED",
    "NOT_OSS",
    "OTHER_GROUP",
    "OTHER_REPLICAS",
    "SHARED_PARAM",
    "TWO_BUCKET_SIZES",
    "bucket_cap",
    "check_optimizers",
    "check_replicas",
    "default_groups",
    "flat_keys",
    "owners_of",
]

#: Raised for a sharded_optimizer that is not an oss_plus OSS (or a list of them).
NOT_OSS = (
    "ShardedDataParallel needs sharded_optimizer to be an oss_plus.OSS (or "
    "oss_plus.compat.fairscale.OSS), or a non-empty list of them; got {given}. Build the "
    "optimizer with OSS(model.parameters(), optim=..., group=...) and pass it"
)
#: Raised when an optimizer shards over other ranks than the wrapper reduces over.
OTHER_GROUP = (
    "ShardedDataParallel: optimizer {index} shards over the ranks {theirs} but process_group "
    "holds the ranks {ours}; pass process_group=<the optimizer's group> (opt.group)"
)
#: Raised when the wrapper's replicate group is not its optimizers'.
OTHER_REPLICAS = (
    "ShardedDataParallel: optimizer {index} replicates its shard over the ranks {theirs} but "
    "replicate_group holds the ranks {ours}; pass replicate_group=<the optimizer's "
    "replicate_group> (or leave it out: the wrapper takes the optimizer's)"
)
#: Raised when trainable params of the module are in no optimizer.
MISSING_PARAMS = (
    "ShardedDataParallel: {count} trainable param(s) of the module are in no sharded "
    "optimizer, so nobody would own their gradient: {names}. Create the optimizer over "
    "every trainable param (model.parameters()) or freeze them (requires_grad=False)"
)
#: Raised when a param is in two optimizers.
SHARED_PARAM = (
    "ShardedDataParallel: param {name!r} is in optimizers {first} and {second}; every param "
    "may be sharded by one optimizer only"
)
#: Raised when both bucket sizes are given.
TWO_BUCKET_SIZES = (
    "ShardedDataParallel: pass reduce_buffer_size (fairscale's, in elements) or "
    "bucket_cap_mb (DDP's, in MiB), not both; got reduce_buffer_size={elements!r} and "
    "bucket_cap_mb={mb!r}"
)
#: Raised when the module's params are on several device types.
MIXED_DEVICE_TYPES = (
    "ShardedDataParallel: the module's params must be on one device type, got {types}; "
    "move the whole module with module.to(device) before wrapping it"
)
#: Raised when a flat-rule optimizer's pieces do not follow the layout of its params.
FLAT_LAYOUT = (
    "ShardedDataParallel: the flat-rule optimizer cut param {index} into {given}, but its "
    "current layout cuts it into {cut}: the params changed (dtype, device, trainability) "
    "and the optimizer has not followed yet. Call refresh_trainable() on the wrapper"
)
#: Raised at forward when a param changed device after wrapping.
MODULE_MOVED = (
    "ShardedDataParallel: param {name!r} moved from {before} to {after} after wrapping; the "
    "sharded optimizer's state stays on the old device. Move the module before creating "
    "the optimizer and the wrapper (changing only the dtype is supported)"
)


def check_optimizers(optimizers: Any, group: Any) -> list[OSS]:
    """Return ``optimizers`` as a list after checking their type and process group.

    Raises:
        TypeError: not an OSS or a non-empty list of OSS.
        ValueError: an optimizer shards over other ranks than ``group``.
    """
    listed = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not listed or not all(isinstance(o, OSS) for o in listed):
        given = type(optimizers).__name__
        if isinstance(optimizers, (list, tuple)):
            given = f"{given} of [{', '.join(type(o).__name__ for o in listed)}]"
        raise TypeError(NOT_OSS.format(given=given))
    ours = dist.get_process_group_ranks(group)
    for index, optimizer in enumerate(listed):
        theirs = dist.get_process_group_ranks(optimizer.group)
        if theirs != ours:
            raise ValueError(OTHER_GROUP.format(index=index, theirs=theirs, ours=ours))
    return list(listed)


def default_groups(optimizers: Any, process_group: Any, replicate_group: Any) -> tuple[Any, Any]:
    """The groups a wrapper uses: those given, else its (first) optimizer's under hybrid
    sharding (``process_group`` None stays WORLD without it, as before)."""
    first = optimizers[0] if isinstance(optimizers, (list, tuple)) and optimizers else optimizers
    theirs = getattr(first, "replicate_group", None)
    if theirs is not None and process_group is None:
        process_group = first.group
    return process_group, replicate_group if replicate_group is not None else theirs


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def check_replicas(optimizers: Sequence[OSS], replicate_group: Any) -> None:
    """Raise unless every optimizer replicates over the ranks of ``replicate_group``.

    Raises:
        ValueError: :data:`OTHER_REPLICAS`.
    """
    ours = _ranks(replicate_group)
    for index, optimizer in enumerate(optimizers):
        theirs = _ranks(getattr(optimizer, "replicate_group", None))
        if theirs != ours:
            raise ValueError(OTHER_REPLICAS.format(index=index, theirs=theirs, ours=ours))


def owners_of(
    optimizers: Sequence[OSS], named: Sequence[tuple[str, torch.Tensor]]
) -> dict[torch.Tensor, int]:
    """Map each param of the optimizers to its owner; check trainable module params are there.

    Raises:
        ValueError: a param in two optimizers, or trainable module params in none.
    """
    owners: dict[torch.Tensor, int] = {}
    seen: dict[torch.Tensor, int] = {}
    names = {p: n for n, p in named}
    for index, optimizer in enumerate(optimizers):
        for param, owner in optimizer.param_to_rank.items():
            if param in seen:
                name = names.get(param, "<not in the module>")
                raise ValueError(SHARED_PARAM.format(name=name, first=seen[param], second=index))
            seen[param] = index
            owners[param] = owner
    missing = [n for n, p in named if p.requires_grad and p not in owners]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(MISSING_PARAMS.format(count=len(missing), names=shown))
    return owners


def flat_keys(optimizers: Sequence[OSS], trainable: Sequence[torch.Tensor]) -> list[FlatKey]:
    """The gradient buffers of the optimizers with the flat rule, read from their public
    plan: per (device, dtype) key, the positions in ``trainable`` of its params and their
    offsets, laid out as the rule cut them.

    Raises:
        ValueError: the plan's pieces do not follow the layout (:data:`FLAT_LAYOUT`): the
            optimizer has not followed a change of the params yet.
    """
    position = {id(p): k for k, p in enumerate(trainable)}
    keys = []
    for optimizer in optimizers:
        plan, params = optimizer.plan, optimizer.flat_params()
        if plan.rule is not Rule.FLAT:
            continue
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, param in enumerate(params):
            if plan.trainable[index]:
                by_key.setdefault((param.device, param.dtype), []).append(index)
        for (device, dtype), members in by_key.items():
            align = alignment(device, dtype) if optimizer.policy.aligned else 1
            numels = [plan.numels[i] for i in members]
            offsets, region = key_layout(numels, align, plan.world_size)
            if not region:
                continue
            for index, offset, numel in zip(members, offsets, numels):
                cut = cut_param(offset, numel, region)
                given = [(p.start, p.end, p.owner) for p in plan.by_index[index]]
                if numel and cut != given:
                    raise ValueError(FLAT_LAYOUT.format(index=index, given=given, cut=cut))
            inside = [(position[id(params[i])], o) for i, o in zip(members, offsets)
                      if id(params[i]) in position]  # fmt: skip
            keys.append(FlatKey(tuple(k for k, _ in inside), tuple(o for _, o in inside), region))
    return keys


def bucket_cap(reduce_buffer_size: int | None, bucket_cap_mb: float | None) -> BucketCap:
    """The buckets' cap: fairscale's ``reduce_buffer_size`` (elements, a bucket closes before
    exceeding it) when given, else DDP's ``bucket_cap_mb`` (default 25 MiB, a bucket closes
    once it reaches it).

    Raises:
        ValueError: both given (:data:`TWO_BUCKET_SIZES`), or a size that is not a number >= 0.

    Example:
        >>> bucket_cap(None, None)
        BucketCap(limit=26214400, in_bytes=True)
        >>> bucket_cap(2**23, None)
        BucketCap(limit=8388608, in_bytes=False)
    """
    if reduce_buffer_size is not None and bucket_cap_mb is not None:
        raise ValueError(TWO_BUCKET_SIZES.format(elements=reduce_buffer_size, mb=bucket_cap_mb))
    if reduce_buffer_size is None:
        return BucketCap.megabytes(DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
    if isinstance(reduce_buffer_size, bool) or not isinstance(reduce_buffer_size, int):
        fix = "fairscale's default is 2**23; 0 sends each gradient alone"
        raise ValueError(
            f"reduce_buffer_size must be an int (elements), got {reduce_buffer_size!r}: {fix}"
        )
    return BucketCap(max(0, reduce_buffer_size))
