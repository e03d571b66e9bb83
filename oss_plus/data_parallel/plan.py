"""PURE: which gradients travel together, to whom, in which order (the reduce plan).

A plan is a frozen value computed from plain data (one :class:`GradSpec` per trainable
param, in the module's registration order) and a bucket size. It is identical on every rank
of the group when the ranks hold the same model and the same partition, which is what makes
the collectives match: buckets are launched strictly in plan order.

Rules:

* a bucket holds params with the same owner, dtype and device;
* the params of a flat key (an optimizer with ``partition_rule="flat"``, :class:`FlatKey`)
  are bucketed by their layout instead: a bucket is a slice of the key's gradient buffer
  inside one rank's range (:mod:`oss_plus.data_parallel.flat`), so a param cut by a range
  boundary has its pieces in the buckets of their ranges (:attr:`Bucket.spans`);
* params are taken in the order backward produces their gradients: as observed in a
  previous backward when given, else *reverse* registration order (DDP's first guess too);
* a bucket closes by its :class:`BucketCap`: by default as DDP's (``bucket_cap_mb``), once
  it holds at least the cap in bytes (the param that reaches the cap is in it); with
  fairscale's ``reduce_buffer_size`` (a plain int), before the next param would take it
  past that many elements (a param larger than that travels alone); a cap of 0 means one
  bucket per param;
* buckets are ordered by the position of their last member in that order, i.e. by when
  backward completes them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from oss_plus.data_parallel.flat import cut_slices

__all__ = [
    "Bucket",
    "BucketCap",
    "DDP_BUCKET_CAP_MB",
    "FlatKey",
    "GradSpec",
    "LaunchGroup",
    "ReducePlan",
    "launch_groups",
    "plan_buckets",
]


@dataclass(frozen=True)
class GradSpec:
    """What the plan needs to know of one trainable param.

    Attributes:
        numel: element count.
        owner: group-local rank that owns the param (its optimizer state and its gradient).
        key: what must be equal for two params to share a flat buffer (dtype, device).
        itemsize: bytes per element (what a cap in bytes counts).
    """

    numel: int
    owner: int
    key: Hashable
    itemsize: int = 4


#: DDP's default ``bucket_cap_mb`` (``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB``).
DDP_BUCKET_CAP_MB = 25.0
#: Raised for a negative or non-numeric bucket size.
BAD_BUCKET_CAP = "{name} must be a number >= 0, got {value!r}: {fix}"


@dataclass(frozen=True)
class BucketCap:
    """When a bucket of one owner and key is full.

    Attributes:
        limit: the cap, in bytes when ``in_bytes`` else in elements; 0: one param per bucket.
        in_bytes: DDP's rule (``bucket_cap_mb``, ``_compute_bucket_assignment_by_size``): a
            bucket closes once it holds at least ``limit`` bytes, the param that reached the
            cap included. False: fairscale's ``reduce_buffer_size``: a bucket closes before
            the next param would take it past ``limit`` elements.

    Raises:
        ValueError: a limit that is not an int >= 0.

    Example:
        >>> BucketCap.megabytes(25).limit
        26214400
        >>> BucketCap(10).fits(8, 3), BucketCap(10, in_bytes=True).fits(8, 3)
        (False, True)
    """

    limit: int
    in_bytes: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            fix = "0 puts every gradient in a bucket of its own"
            raise ValueError(
                BAD_BUCKET_CAP.format(name="the bucket cap", value=self.limit, fix=fix)
            )

    @classmethod
    def megabytes(cls, bucket_cap_mb: float) -> BucketCap:
        """DDP's cap of ``bucket_cap_mb`` MiB (as DDP: ``int(bucket_cap_mb * 2**20)`` bytes).

        Raises:
            ValueError: not a number >= 0.
        """
        ok = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
        if not ok or bucket_cap_mb < 0:
            fix = f"DDP's default is {DDP_BUCKET_CAP_MB}"
            raise ValueError(
                BAD_BUCKET_CAP.format(name="bucket_cap_mb", value=bucket_cap_mb, fix=fix)
            )
        return cls(int(bucket_cap_mb * 2**20), in_bytes=True)

    def fits(self, size: int, add: int) -> bool:
        """Whether a bucket already holding ``size`` (elements or bytes) takes ``add`` more."""
        if self.in_bytes:
            return size < self.limit  # not yet full: the next param goes in
        return self.limit > 0 and size + add <= self.limit

    def elements(self, itemsize: int) -> int:
        """The cap in elements of ``itemsize`` bytes (the flat rule's slices)."""
        return self.limit // itemsize if self.in_bytes else self.limit


@dataclass(frozen=True)
class FlatKey:
    """The gradient buffer of one flat key (:mod:`oss_plus.data_parallel.flat`).

    Attributes:
        params: indices into the spec list, in the key's flat order.
        offsets: each param's offset in the buffer.
        region: the size of every rank's range.
    """

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    region: int


@dataclass(frozen=True)
class Bucket:
    """Params (indices into the spec list) reduced together to ``owner`` in one collective.

    Attributes:
        owner: group-local rank receiving the sum.
        members: indices of the params, in the order of their slices in the flat buffer.
        offsets: element offset of each member in the flat buffer.
        numel: total element count of the flat buffer.
        spans: of a flat key's bucket, ``(start, end)`` of the flattened param each member
            holds here (a param cut by a range boundary is in several buckets); empty for
            whole params.
        base: of a flat key's bucket, its offset in the owner's range (-1: not flat).
    """

    owner: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    spans: tuple[tuple[int, int], ...] = ()
    base: int = -1


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
    specs: Sequence[GradSpec],
    bucket_numel: int | BucketCap,
    order: Sequence[int] | None = None,
    flat: Sequence[FlatKey] = (),
) -> ReducePlan:
    """Group ``specs`` into buckets closed by ``bucket_numel`` (see module doc).

    Args:
        specs: one entry per trainable param, in registration order.
        bucket_numel: a :class:`BucketCap`, or fairscale's largest bucket in elements (an
            int; 0 or less puts each param alone).
        order: the order in which backward produces the gradients (indices into ``specs``,
            as observed in a previous backward); params missing from it follow, in reverse
            registration order. Default: reverse registration order.
        flat: the flat keys; their params are bucketed by their layout.

    Returns:
        The plan; ``position[i]`` is ``(bucket index, slot index)`` of param ``i`` (of a
        param in several buckets, the first).

    Example:
        >>> specs = [GradSpec(1, 0, "f")] * 3
        >>> [b.members for b in plan_buckets(specs, 0, order=[1, 0, 2]).buckets]
        [(1,), (0,), (2,)]
    """
    cap = bucket_numel if isinstance(bucket_numel, BucketCap) else BucketCap(max(0, bucket_numel))
    seen = set(order or ())
    ready = [*(order or ()), *(i for i in reversed(range(len(specs))) if i not in seen)]
    rank_of = {index: k for k, index in enumerate(ready)}
    in_flat = {i for key in flat for i in key.params}
    open_: dict[tuple[int, Hashable], tuple[list[int], int]] = {}
    closed: list[tuple[int, Bucket]] = []  # (position of the last member, bucket)
    for index in ready:
        if index in in_flat:
            continue
        spec = specs[index]
        slot_key = (spec.owner, spec.key)
        members, size = open_.get(slot_key, ([], 0))
        add = spec.numel * spec.itemsize if cap.in_bytes else spec.numel
        if members and not cap.fits(size, add):
            closed.append(_whole(members, specs, rank_of))
            members, size = [], 0
        members.append(index)
        open_[slot_key] = (members, size + add)
    closed.extend(_whole(m, specs, rank_of) for m, _ in open_.values() if m)
    closed.extend(_flat_buckets(flat, specs, cap, rank_of))
    closed.sort(key=lambda item: item[0])
    buckets = tuple(bucket for _, bucket in closed)
    position: dict[int, tuple[int, int]] = {}
    for b, bucket in enumerate(buckets):
        for slot, index in enumerate(bucket.members):
            position.setdefault(index, (b, slot))
    return ReducePlan(buckets, position)


def _whole(
    members: list[int], specs: Sequence[GradSpec], rank_of: dict[int, int]
) -> tuple[int, Bucket]:
    offsets, total = [], 0
    for index in members:
        offsets.append(total)
        total += specs[index].numel
    bucket = Bucket(specs[members[0]].owner, tuple(members), tuple(offsets), total)
    return max(rank_of[i] for i in members), bucket


def _flat_buckets(
    flat: Sequence[FlatKey],
    specs: Sequence[GradSpec],
    cap: BucketCap,
    rank_of: dict[int, int],
) -> list[tuple[int, Bucket]]:
    out = []
    for key in flat:
        numels = [specs[i].numel for i in key.params]
        limit = cap.elements(specs[key.params[0]].itemsize) if key.params else 0
        cuts = cut_slices(key.params, numels, key.offsets, key.region, limit, cap.in_bytes)
        for cut in cuts:
            where = dict(zip(key.params, key.offsets))
            members = tuple(i for i, _, _ in cut.members)
            offsets = tuple(where[i] + start - cut.lo for i, start, _ in cut.members)
            spans = tuple((start, end) for _, start, end in cut.members)
            base = cut.lo - cut.owner * key.region
            bucket = Bucket(cut.owner, members, offsets, cut.hi - cut.lo, spans, base)
            out.append((max(rank_of[i] for i in members), bucket))
    return out


@dataclass(frozen=True)
class LaunchGroup:
    """Buckets sent in one collective: one bucket (``dist.reduce`` to its owner), or up to
    one bucket per owner (``reduce_scatter_tensor``: segment ``r`` of the input holds rank
    ``r``'s bucket, every segment padded to ``segment`` elements). A flat key's bucket is
    always alone (its slice of the range is reduced in place).

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
    ``keys[b]`` is bucket ``b``'s dtype and device), or one bucket each. A flat key's
    bucket is always alone.

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
        split = bucket.base >= 0 or (current and plan.buckets[current[0]].base >= 0)
        if current and (clash or split or keys[current[0]] != keys[b]):
            groups.append(LaunchGroup(tuple(current), max(plan.buckets[c].numel for c in current)))
            current = []
        current.append(b)
    if current:
        groups.append(LaunchGroup(tuple(current), max(plan.buckets[c].numel for c in current)))
    return tuple(groups)
