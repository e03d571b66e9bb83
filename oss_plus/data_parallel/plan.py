"""PURE: which gradients travel together, to whom, in which order (the reduce plan).

A plan is a frozen value computed from plain data (one :class:`GradSpec` per trainable
param, in the module's registration order) and a bucket size. It is identical on every rank
of the group when the ranks hold the same model and the same partition, which is what makes
the collectives match: buckets are launched strictly in plan order.

Rules:

* a bucket holds params with the same owner, dtype and device;
* a param split into pieces by the flat partition rule (:attr:`GradSpec.pieces`) travels
  alone, in a *split bucket* (owner ``-1``): each piece's slice of the gradient is reduced
  to that piece's owner;
* params are taken in the order backward produces their gradients: as observed in a
  previous backward when given, else *reverse* registration order (DDP's first guess too),
  and a bucket is closed when the next param would take it past ``bucket_numel``
  elements; a param larger than that travels alone; ``bucket_numel=0`` means one bucket
  per param;
* buckets are ordered by the position of their last member in that order, i.e. by when
  backward completes them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Bucket", "GradSpec", "LaunchGroup", "ReducePlan", "launch_groups", "plan_buckets"]


@dataclass(frozen=True)
class GradSpec:
    """What the plan needs to know of one trainable param.

    Attributes:
        numel: element count.
        owner: group-local rank that owns the param (its optimizer state and its gradient).
        key: what must be equal for two params to share a flat buffer (dtype, device).
        pieces: for a param split across ranks (flat partition rule), ``(start, end,
            owner)`` of every piece of the flattened param; empty for a whole param.
    """

    numel: int
    owner: int
    key: Hashable
    pieces: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Bucket:
    """Params (indices into the spec list) reduced together to ``owner`` in one collective.

    Attributes:
        owner: group-local rank receiving the sum (-1: a split bucket, see ``pieces``).
        members: indices of the params, in the order of their slices in the flat buffer.
        offsets: element offset of each member in the flat buffer.
        numel: total element count of the flat buffer.
        pieces: of a split bucket (one param), ``(start, end, owner)`` of every piece: each
            slice is reduced to its owner.
    """

    owner: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    pieces: tuple[tuple[int, int, int], ...] = ()

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` receives (part of) this bucket's sum."""
        return self.owner == rank or any(owner == rank for _, _, owner in self.pieces)


@dataclass(frozen=True)
class ReducePlan:
    """The buckets in launch order, and for each param its (bucket, slot) position.

    Example:
        >>> specs = [GradSpec(4, 0, "f32"), GradSpec(2, 1, "f32"), GradSpec(3, 0, "f32")]
        >>> p = plan_buckets(specs, bucket_numel=100)
        >>> [(b.owner, b.members, b.offsets) for b in p.buckets]
        [(1, (1,), (0,)), (0, (2, 0), (0, 3))]
        >>> p.position[0]
        (1, 1)
    """

    buckets: tuple[Bucket, ...]
    position: dict[int, tuple[int, int]]


def plan_buckets(
    specs: Sequence[GradSpec], bucket_numel: int, order: Sequence[int] | None = None
) -> ReducePlan:
    """Group ``specs`` into buckets of at most ``bucket_numel`` elements (see module doc).

    Args:
        specs: one entry per trainable param, in registration order.
        bucket_numel: the largest bucket in elements; 0 (or less) puts each param alone.
        order: the order in which backward produces the gradients (indices into ``specs``,
            as observed in a previous backward); params missing from it follow, in reverse
            registration order. Default: reverse registration order.

    Returns:
        The plan; ``position[i]`` is ``(bucket index, slot index)`` of param ``i``.

    Example:
        >>> specs = [GradSpec(1, 0, "f")] * 3
        >>> [b.members for b in plan_buckets(specs, 0, order=[1, 0, 2]).buckets]
        [(1,), (0,), (2,)]
    """
    seen = set(order or ())
    ready = [*(order or ()), *(i for i in reversed(range(len(specs))) if i not in seen)]
    rank_of = {index: k for k, index in enumerate(ready)}
    open_: dict[tuple[int, Hashable], list[int]] = {}
    closed: list[tuple[int, list[int]]] = []  # (position of the last member, members)
    for index in ready:
        spec = specs[index]
        if spec.pieces:  # alone, completed by its own gradient
            closed.append((rank_of[index], [index]))
            continue
        slot_key = (spec.owner, spec.key)
        members = open_.get(slot_key, [])
        size = sum(specs[i].numel for i in members)
        if members and (bucket_numel <= 0 or size + spec.numel > bucket_numel):
            closed.append((max(rank_of[i] for i in members), members))
            members = []
        members.append(index)
        open_[slot_key] = members
    closed.extend((max(rank_of[i] for i in m), m) for m in open_.values() if m)
    closed.sort(key=lambda item: item[0])
    buckets = []
    position: dict[int, tuple[int, int]] = {}
    for b, (_, members) in enumerate(closed):
        offsets, total = [], 0
        for slot, index in enumerate(members):
            offsets.append(total)
            total += specs[index].numel
            position[index] = (b, slot)
        pieces = specs[members[0]].pieces
        owner = -1 if pieces else specs[members[0]].owner
        buckets.append(Bucket(owner, tuple(members), tuple(offsets), total, pieces))
    return ReducePlan(tuple(buckets), position)


@dataclass(frozen=True)
class LaunchGroup:
    """Buckets sent in one collective: one bucket (``dist.reduce`` to its owner), or up to
    one bucket per owner (``reduce_scatter_tensor``: segment ``r`` of the input holds rank
    ``r``'s bucket, every segment padded to ``segment`` elements).

    Attributes:
        buckets: bucket indices, in plan order.
        segment: the padded segment length (the largest bucket of the group).
    """

    buckets: tuple[int, ...]
    segment: int


def launch_groups(
    plan: ReducePlan, scatter: bool, keys: Sequence[Hashable] | None = None
) -> tuple[LaunchGroup, ...]:
    """Group consecutive buckets with distinct owners and equal keys (``scatter``, where
    ``keys[b]`` is bucket ``b``'s dtype and device), or one bucket each. A split bucket is
    always alone (its pieces are reduced one by one).

    Groups keep the plan order, so launching them in order launches the buckets in order.

    Example:
        >>> specs = [GradSpec(4, 0, "f"), GradSpec(2, 1, "f"), GradSpec(3, 0, "f")]
        >>> plan = plan_buckets(specs, bucket_numel=0)
        >>> [(g.buckets, g.segment) for g in launch_groups(plan, scatter=True)]
        [((0, 1), 3), ((2,), 4)]
    """
    if not scatter:
        return tuple(LaunchGroup((b,), bucket.numel) for b, bucket in enumerate(plan.buckets))
    keys = keys if keys is not None else [None] * len(plan.buckets)
    groups: list[LaunchGroup] = []
    current: list[int] = []
    for b, bucket in enumerate(plan.buckets):
        clash = any(plan.buckets[c].owner == bucket.owner for c in current)
        split = bucket.pieces or (current and plan.buckets[current[0]].pieces)
        if current and (clash or split or keys[current[0]] != keys[b]):
            groups.append(LaunchGroup(tuple(current), max(plan.buckets[c].numel for c in current)))
            current = []
        current.append(b)
    if current:
        groups.append(LaunchGroup(tuple(current), max(plan.buckets[c].numel for c in current)))
    return tuple(groups)
