"""Bucket layouts for the parameter sync (no collectives): which params share a flat buffer,
where each one starts, and how a buffer's views replace the params' storage.

A layout is a list of ready-made :class:`Bucket` objects (plus, for the ``all_gather``
transport, the :class:`Gather` buffers they are views of); :class:`oss_plus.wire.sync.BucketSync`
only moves their bytes. The layouts:

* :func:`owner_buckets` (the core's and fairscale's): for every (device, dtype, owner rank)
  one flat buffer of that owner's *trainable* params in ascending element count (stable),
  each at an allocator-aligned offset (or back to back when not ``aligned``);
* :func:`ordered_buckets` (torch ZeRO's ``parameters_as_bucket_view``): the same, params in
  the owner's local order, back to back;
* :func:`per_param` (torch ZeRO's default): every param (frozen ones too) is its own bucket,
  sent from its own storage;
* the overlap's pieces (:mod:`oss_plus.overlap.layout`), one bucket per (DDP bucket, owner),
  built with :func:`lay_out`;
* :func:`flat_buckets` (the flat partition rule): per (device, dtype) one buffer of every
  trainable param in flat order, cut into ``world_size`` equal ranges; range ``r`` is rank
  ``r``'s bucket (a param may span ranges: it is cut into pieces, see :mod:`oss_plus.step.pieces`).
  Broadcast ranges are each followed by their rank's status slot when that costs little
  memory (:data:`SLOTTED_SHARE`): a param that spans ranges then keeps storage of its own,
  filled by the sync from its pieces (:attr:`Bucket.pieces`). Otherwise the ranges are back
  to back and carry no slot, and the sync sends every rank's code in one small
  ``all_gather``.

Status slot: a flat bucket carries one element after its params' region. Its owner writes
its step status there (0: ok, 1: its local step raised) before sending, so every receiver
learns whether the owner failed with no collective of its own. In a :class:`Gather`, the
last element of every rank's region is that rank's slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from oss_plus.planning.partition import flat_offsets, padded
from oss_plus.planning.policy import Transport
from oss_plus.wire.main.region import MainCopy

__all__ = [
    "Bucket",
    "Key",
    "Gather",
    "SLOTTED_SHARE",
    "Transport",
    "alignment",
    "bucket_numel",
    "lay_out",
    "flat_buckets",
    "ordered_buckets",
    "owner_buckets",
    "per_param",
    "own_storage",
    "padded",
]

Key = tuple[str, torch.dtype]

#: A flat-rule key whose ranges travel by broadcast gets a status slot after each range when
#: the params its range boundaries cut (which then need a copy of their own) hold at most this
#: share of its elements: on gloo a small ``all_gather`` more per step costs about as much as
#: a broadcast (0.31 ms against 0.43 ms for two broadcasts of 64K floats, 2 ranks).
SLOTTED_SHARE = 1 / 16


def _wire_buffer(
    cache: dict[torch.dtype, torch.Tensor], like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    if dtype not in cache:
        cache[dtype] = torch.empty(like.numel(), dtype=dtype, device=like.device)
    return cache[dtype]


@dataclass(eq=False)
class Bucket:
    """One flat buffer: params of ``owner`` with one device and dtype.

    Attributes:
        owner: the group-local rank that updates these params and sends them.
        buffer: the params' region; each param is a view of it (when ``views``).
        params: the members, in layout order.
        flat: what travels: ``buffer`` followed by the status slot (or ``buffer`` itself
            when the bucket has no slot).
        views: the params are views of ``buffer`` (False: ``buffer`` is a param's own
            storage, :func:`per_param`).
        via: the transport of this bucket.
        pieces: ``(param, start, view)`` for every piece of a param that spans buckets (the
            flat rule): the elements ``[start, start + view.numel())`` of the flattened param
            live in ``view``, a view of ``buffer``; the param has storage of its own.
    """

    owner: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    flat: torch.Tensor | None = None
    views: bool = True
    via: Transport = Transport.BROADCAST
    pieces: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list, repr=False)
    wire: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)
    slot: torch.Tensor | None = field(init=False, repr=False)
    #: the status code last written into ``slot`` by this rank (slots start at 0)
    status: int = field(default=0, init=False, repr=False)
    #: the exact values of ``flat`` while this rank sends it compressed
    main: MainCopy | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.flat is None:
            self.flat = self.buffer
        #: the status slot (a 1-element view of ``flat``), or None
        self.slot = self.flat[-1:] if self.flat.numel() > self.buffer.numel() else None

    def wire_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the preallocated compressed copy of :attr:`flat` (allocated on first use)."""
        assert self.flat is not None
        return _wire_buffer(self.wire, self.flat, dtype)


@dataclass(eq=False)
class Gather:
    """The ``all_gather`` layout of one (device, dtype): ``region`` elements per rank, the
    last of which is that rank's status slot."""

    flat: torch.Tensor
    region: int
    wire: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)
    #: every region ends with its rank's status slot (False: the regions are all params)
    slots: bool = True
    #: the status code last written into this rank's slot (slots start at 0)
    status: int = field(default=0, init=False, repr=False)
    #: the exact values of this rank's region while it sends it compressed
    main: MainCopy | None = field(default=None, init=False, repr=False)

    def slot(self, rank: int) -> torch.Tensor:
        """Return the status slot of ``rank`` (a 1-element view)."""
        end = (rank + 1) * self.region
        return self.flat[end - 1 : end]

    def wire_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the preallocated compressed copy of ``flat`` (allocated on first use)."""
        return _wire_buffer(self.wire, self.flat, dtype)


def alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Return the element alignment of a param inside a bucket.

    Each param starts where a standalone tensor would (64 bytes on CPU, 512 on accelerators,
    as torch's allocators align), so kernels take the same code paths and fp32 results stay
    bit-identical to the unsharded model's.
    """
    nbytes = 64 if device.type == "cpu" else 512
    return max(1, nbytes // dtype.itemsize)


def bucket_numel(params: Sequence[torch.Tensor], aligned: bool) -> int:
    """Return the elements of a bucket holding ``params`` (alignment padding included)."""
    if not params:
        return 0
    align = alignment(params[0].device, params[0].dtype) if aligned else 1
    return sum(padded(p.numel(), align) for p in params)


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """Return a tensor over the memory of ``view`` whose storage object is its own.

    safetensors, Accelerate and transformers group tensors by storage to find tied weights:
    params that are views of one bucket would be refused (``save_model``) or dropped
    (``save_state``). A DLPack round trip wraps the same memory in a new storage that starts
    at the view's first element and keeps the bucket alive, so every param looks like a
    standalone tensor while the bucket's collectives still update it in place. Done once per
    layout, never per step. Falls back to the plain view where DLPack cannot export the dtype.
    """
    try:
        owned = torch.from_dlpack(view.detach())
    except (BufferError, RuntimeError, TypeError):
        return view
    # torch 2.6's DLPack import sets the strides of size-1 dims to 1 ((1, 12): (12, 1) ->
    # (1, 1)), and some CPU kernels then round differently than for the unsharded param
    if owned.stride() != view.stride():
        owned = owned.as_strided(view.shape, view.stride())
    return owned


@torch.no_grad()
def lay_out(
    owner: int,
    params: Sequence[torch.Tensor],
    aligned: bool,
    buffer: torch.Tensor | None = None,
) -> Bucket:
    """Make ``params`` views into ``buffer`` (by default a new zeroed one with a status slot),
    copying their current values in.

    Args:
        owner: the group-local rank that updates these params.
        params: the members, in layout order.
        aligned: start each at an allocator-aligned offset (else back to back).
        buffer: where to lay them out (at least :func:`bucket_numel` elements; the bucket
            then has no status slot of its own).
    """
    numel = bucket_numel(params, aligned)
    flat = None
    if buffer is None:
        flat = torch.zeros(numel + 1, dtype=params[0].dtype, device=params[0].device)
        buffer = flat[:numel]
    align = alignment(params[0].device, params[0].dtype) if aligned else 1
    offset = 0
    for p in params:
        view = buffer[offset : offset + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = own_storage(view)
        offset += padded(p.numel(), align)
    return Bucket(owner, buffer[:numel], list(params), flat)


def _by_key(params: Sequence[torch.Tensor], order_by_size: bool) -> list[list[torch.Tensor]]:
    """Group trainable ``params`` by (device, dtype), optionally by ascending size (stable)."""
    trainable = [p for p in params if p.requires_grad]
    if order_by_size:
        trainable.sort(key=lambda p: p.numel())
    by_key: dict[Key, list[torch.Tensor]] = {}
    for p in trainable:
        by_key.setdefault((str(p.device), p.dtype), []).append(p)
    return list(by_key.values())


def owner_buckets(
    params_by_owner: Sequence[Sequence[torch.Tensor]],
    aligned: bool,
    gathered: Sequence[Key] = (),
) -> tuple[list[Bucket], list[Gather]]:
    """Lay out every owner's trainable params in ascending size, one bucket per key.

    Args:
        params_by_owner: for every group-local rank, the params it owns (any order).
        aligned: start every param at an allocator-aligned offset.
        gathered: the (device, dtype) keys that travel by ``all_gather``: their buckets are
            views of one :class:`Gather` buffer with an equal region per rank.

    Returns:
        The buckets (by owner, then key) and the gather buffers.
    """
    world = len(params_by_owner)
    layout = [
        (owner, (str(ms[0].device), ms[0].dtype), ms)
        for owner, params in enumerate(params_by_owner)
        for ms in _by_key(params, order_by_size=True)
    ]
    regions: dict[Key, Gather] = {}
    for key in dict.fromkeys(k for _, k, _ in layout):
        if key in gathered:
            device = torch.device(key[0])
            largest = max(bucket_numel(m, aligned) for _, k, m in layout if k == key)
            region = padded(largest + 1, alignment(device, key[1]))
            flat = torch.zeros(world * region, dtype=key[1], device=device)
            regions[key] = Gather(flat, region)
    buckets = []
    for owner, key, members in layout:
        if key in regions:
            g = regions[key]
            bucket = lay_out(owner, members, aligned, g.flat[owner * g.region :])
            bucket.via = Transport.ALL_GATHER
        else:
            bucket = lay_out(owner, members, aligned)
        buckets.append(bucket)
    return buckets, list(regions.values())


def ordered_buckets(params_by_owner: Sequence[Sequence[torch.Tensor]]) -> list[Bucket]:
    """torch's bucket views: each owner's trainable params back to back, in the given order."""
    return [
        lay_out(owner, members, aligned=False)
        for owner, params in enumerate(params_by_owner)
        for members in _by_key(params, order_by_size=False)
    ]


def per_param(params_by_owner: Sequence[Sequence[torch.Tensor]]) -> list[Bucket]:
    """torch's default: every param (frozen ones too) sent from its own storage, no slot."""
    return [
        Bucket(owner, p.data, [p], views=False)
        for owner, params in enumerate(params_by_owner)
        for p in params
    ]


def flat_buckets(
    params: Sequence[torch.Tensor], world_size: int, aligned: bool, gathered: Sequence[Key] = ()
) -> tuple[list[Bucket], list[Gather]]:
    """The flat rule's layout: per (device, dtype), every trainable param of ``params`` (flat
    order) at the offsets of :func:`oss_plus.planning.partition.flat_offsets`, cut into
    ``world_size`` equal ranges; one bucket per range, owned by its rank.

    The same offsets and ranges as :func:`oss_plus.planning.partition.cut_flat` (given the same
    alignment), so rank ``r``'s bucket holds exactly the pieces it owns. A param inside one
    range is a view of it. Keys in ``gathered`` travel by one ``all_gather`` of the whole
    buffer (a :class:`Gather` without status slots): their ranges are back to back and a
    param that spans ranges is a view across them. So are broadcast ranges, unless the
    params their boundaries cut hold at most :data:`SLOTTED_SHARE` of the key's elements:
    then every range is followed by one alignment unit whose last element is its rank's
    status slot (every code travels with its range, no status collective), and a param that
    spans ranges keeps storage of its own (a view could not skip the slots) while its pieces
    are views of their ranges (:attr:`Bucket.pieces`). A bucket lists the params that start
    in it.
    """
    buckets: list[Bucket] = []
    gathers: list[Gather] = []
    for members in _by_key(params, order_by_size=False):
        device, dtype = members[0].device, members[0].dtype
        align = alignment(device, dtype) if aligned else 1
        numels = [p.numel() for p in members]
        offsets, region = flat_offsets(numels, align, world_size)
        if region == 0:
            continue
        via = Transport.ALL_GATHER if (str(device), dtype) in gathered else Transport.BROADCAST
        cut = sum(n for n, o in zip(numels, offsets) if n and o // region != (o + n - 1) // region)
        slotted = via is Transport.BROADCAST and cut <= SLOTTED_SHARE * sum(numels)
        block = region + align if slotted else region  # a slotted range, then its slot
        buffer = torch.zeros(world_size * block, dtype=dtype, device=device)
        if via is Transport.ALL_GATHER:
            gathers.append(Gather(buffer, region, slots=False))
        ranges = [
            Bucket(
                rank,
                buffer[rank * block : rank * block + region],
                [],
                buffer[rank * block : (rank + 1) * block] if slotted else None,
                via=via,
            )
            for rank in range(world_size)
        ]
        for p, offset in zip(members, offsets):
            _place(p, offset, region, block, buffer, ranges)
        buckets.extend(ranges)
    return buckets, gathers


@torch.no_grad()
def _place(
    p: torch.Tensor,
    offset: int,
    region: int,
    block: int,
    buffer: torch.Tensor,
    ranges: list[Bucket],
) -> None:
    """Put ``p`` (flat offset ``offset``) into the ranges of :func:`flat_buckets`: a view of
    ``buffer``, unless it spans ranges followed by slots (``block > region``)."""
    numel = p.numel()
    first = min(offset // region, len(ranges) - 1)
    last = max(first, (offset + numel - 1) // region)
    ranges[first].params.append(p)
    if first == last or block == region:
        start = first * block + offset - first * region
        view = buffer[start : start + numel].view_as(p)
        view.copy_(p.data)
        p.data = own_storage(view)
        return
    p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(p.data)
    flat = p.data.view(-1)
    for rank in range(first, last + 1):
        low, high = max(offset, rank * region), min(offset + numel, (rank + 1) * region)
        at = rank * block + low - rank * region
        view = buffer[at : at + high - low]
        view.copy_(flat[low - offset : high - offset])
        ranges[rank].pieces.append((p, low - offset, view))
