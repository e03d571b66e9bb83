"""PURE planning for overlapping the sharded step with DDP's gradient buckets (no torch).

A DDP gradient bucket is described by the element counts of its params, in bucket order.
An :class:`Assignment` gives a contiguous slice of one bucket to one rank, which steps those
params once the bucket's gradients are reduced and then broadcasts them.

* :func:`torch_assignments` reproduces ``torch.distributed.optim.ZeroRedundancyOptimizer``'s
  rule for ``overlap_with_ddp=True``: bucket ``b`` to rank ``b % world_size``, or with
  ``shard_buckets`` the buckets in increasing size, each cut into slices below
  ``total / world_size`` handed to the least-loaded rank not yet holding part of it.
* :func:`owner_pieces` splits one bucket by existing owners (the core optimizer keeps its
  own partition; each owner's params in the bucket form one piece).
* :func:`local_order` lists what a rank owns in the order torch's local optimizer holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Assignment", "local_order", "owner_pieces", "torch_assignments"]

#: Raised for a bucket without params (DDP never builds one).
EMPTY_BUCKET = "bucket {index} has no params: every DDP gradient bucket holds at least one"


@dataclass(frozen=True)
class Assignment:
    """Params ``start:stop`` (positions in DDP bucket ``bucket``) are stepped by ``owner``."""

    bucket: int
    owner: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"an assignment needs 0 <= start < stop, got {self.start}:{self.stop}")


def _least_loaded(loads: Sequence[float], taken: set[int]) -> int:
    """Return the first rank with the smallest load outside ``taken``.

    torch raises an AssertionError when every rank already holds part of the bucket (a
    bucket cut into more slices than ranks, possible with uneven param sizes); the least
    loaded rank overall is used instead, so one rank may hold two slices of a bucket.
    """
    candidates = [r for r in range(len(loads)) if r not in taken] or list(range(len(loads)))
    best = candidates[0]
    for rank in candidates[1:]:
        if loads[rank] < loads[best]:
            best = rank
    return best


def torch_assignments(
    bucket_sizes: Sequence[Sequence[int]], world_size: int, shard_buckets: bool
) -> list[Assignment]:
    """Return torch ZeRO's bucket assignments, in the order torch makes them.

    Args:
        bucket_sizes: for every DDP bucket (by index), the element count of each param.
        world_size: ranks in the group.
        shard_buckets: cut buckets across ranks (torch's ``shard_buckets=True``).

    Returns:
        The assignments; a rank's local optimizer holds its params in this order.

    Raises:
        ValueError: a bucket without params, or ``world_size < 1``.

    Example:
        >>> [(a.bucket, a.owner) for a in torch_assignments([[4], [2, 2], [1]], 2, False)]
        [(0, 0), (1, 1), (2, 0)]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for index, sizes in enumerate(bucket_sizes):
        if not sizes:
            raise ValueError(EMPTY_BUCKET.format(index=index))
    if not shard_buckets:
        return [Assignment(b, b % world_size, 0, len(s)) for b, s in enumerate(bucket_sizes)]
    threshold = sum(sum(s) for s in bucket_sizes) / world_size
    loads = [0] * world_size
    result: list[Assignment] = []
    for bucket in sorted(range(len(bucket_sizes)), key=lambda b: sum(bucket_sizes[b])):
        sizes, start, size = bucket_sizes[bucket], 0, 0
        taken: set[int] = set()
        for position, numel in enumerate(sizes):
            if size + numel >= threshold and position > start:
                owner = _least_loaded(loads, taken)
                result.append(Assignment(bucket, owner, start, position))
                taken.add(owner)
                loads[owner] += size
                start, size = position, 0
            size += numel
        owner = _least_loaded(loads, taken)
        result.append(Assignment(bucket, owner, start, len(sizes)))
        loads[owner] += size
    return result


def owner_pieces(owners: Sequence[int | None]) -> list[tuple[int, list[int]]]:
    """Split one bucket by the owners of its params (None: not optimized, skipped).

    Args:
        owners: the owner of each param of the bucket, in bucket order.

    Returns:
        ``(owner, positions)`` for every owner present, by ascending owner; positions keep
        bucket order.

    Example:
        >>> owner_pieces([1, 0, 1, None])
        [(0, [1]), (1, [0, 2])]
    """
    pieces: dict[int, list[int]] = {}
    for position, owner in enumerate(owners):
        if owner is not None:
            pieces.setdefault(owner, []).append(position)
    return sorted(pieces.items())


def local_order(assignments: Sequence[Assignment], rank: int) -> list[tuple[int, int]]:
    """Return ``(bucket, position)`` of every param ``rank`` steps, in torch's local order.

    Example:
        >>> local_order([Assignment(0, 1, 0, 2), Assignment(1, 0, 0, 1)], 1)
        [(0, 0), (0, 1)]
    """
    return [
        (a.bucket, position)
        for a in assignments
        if a.owner == rank
        for position in range(a.start, a.stop)
    ]
