"""The pieces of a param as one torch ``ShardedTensor`` of the param's shape, and back.

Under ``partition_rule="flat"`` a param may be cut into pieces held by several ranks, each
a 1-D range of the param's flattened elements. DCP saves a tensor by its chunks, which are
rectangles: :func:`range_blocks` (PURE) cuts a range into rectangles whose elements are
contiguous, :func:`to_sharded` makes one ``ShardedTensor`` whose local shards are views of
this rank's piece (no copy, no collective), and :func:`local_piece` turns a loaded one back
into this rank's 1-D piece. :mod:`oss_plus.state.dcp` builds the DCP state dict with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from oss_plus.runtime import dist as _dist

__all__ = ["holds_sharded", "local_piece", "range_blocks", "to_sharded"]


def range_blocks(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut the elements ``[start, end)`` of a C-order tensor of ``shape`` into rectangles.

    Returns ``(offsets, sizes)`` of each rectangle, in element order; each one's elements
    are contiguous in the flattened tensor, so a 1-D piece holds them back to back (PURE).

    Example:
        >>> range_blocks((3, 4), 2, 11)
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
        >>> range_blocks((4, 2), 2, 8)
        [((1, 0), (3, 2))]
    """
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = 1
    for size in shape[1:]:
        inner *= size
    first, first_off = divmod(start, inner)
    last, last_off = divmod(end, inner)
    rest = tuple(shape[1:])

    def rows(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in range_blocks(rest, lo, hi)]

    if first == last:
        return rows(first, first_off, last_off)
    blocks = []
    if first_off:
        blocks += rows(first, first_off, inner)
        first += 1
    if last > first:
        blocks.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if last_off:
        blocks += rows(last, 0, last_off)
    return blocks


def to_sharded(
    piece: torch.Tensor, shape: tuple[int, ...], pieces: list[Any], rank: int, group: Any
) -> Any:
    """A ``ShardedTensor`` of ``shape``: this rank's shards are views of ``piece`` (1-D)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    everyone, local = [], []
    for p in pieces:
        device = piece.device if p.owner == rank else torch.device(piece.device.type)
        place = f"rank:{_dist.global_rank(group, p.owner)}/{device}"
        at = 0
        for offsets, sizes in range_blocks(shape, p.start, p.end):
            meta = ShardMetadata(list(offsets), list(sizes), place)
            everyone.append(meta)
            if p.owner == rank:
                view = piece[at : at + math.prod(sizes)].view(sizes)
                local.append(Shard(tensor=view, metadata=meta))
            at += math.prod(sizes)
    props = TensorProperties(dtype=piece.dtype, requires_grad=False)
    meta_all = ShardedTensorMetadata(everyone, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, meta_all, process_group=group
    )


def local_piece(value: Any) -> Any:
    """A ``ShardedTensor``'s local shards as one 1-D tensor (this rank's piece)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return value
    shards = value.local_shards()
    if not shards:
        return None
    return torch.cat([s.tensor.reshape(-1) for s in shards])


def holds_sharded(state: Mapping[str, Any]) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return any(isinstance(v, ShardedTensor) for v in state.values())
