"""Parameter synchronisation after the local step: flat buckets, transports, wire compression.

Layout (fairscale's): for every (device, dtype, owner rank) there is one flat buffer holding
that owner's *trainable* parameters in ascending element count, each starting at an aligned
offset (see :func:`alignment`); each parameter's ``.data`` is a view into its buffer, so the
owner's update lands in the buffer with no copy. Frozen parameters are never sent.

Transports (:class:`Transport`), chosen when the layout is built, identically on every rank:

* ``broadcast``: one async broadcast per bucket from its owner. Works everywhere.
* ``all_gather``: per (device, dtype) one flat buffer with an equal, padded region per rank
  (the buckets are views of it) and one ``all_gather_single`` per buffer. The default for CUDA
  buckets on NCCL (one collective per dtype instead of one per rank). Slow on gloo.

Every byte moves through ``torch.distributed`` collectives on the optimizer's group: oss_plus
writes no transport of its own (a shared-memory path measured faster on one host, but it is
a transport of our own that only works on one host, and it was removed).

``transport="auto"`` picks the defaults above; the environment variable :data:`TRANSPORT_ENV`
overrides ``auto`` (set it identically on every rank).

Compression: when a wire dtype narrower than a bucket's dtype is requested (fp16/bf16), the
owner copies its buffer into a preallocated wire buffer which is sent instead; receivers widen
it into their buffer. The owner's own values are never rounded, so updates smaller than the
wire format's resolution still accumulate on the owner, and replicas hold the owner's values
rounded to the wire dtype until the next step.

Buffers are allocated when the layout is built (construction, ``add_param_group``,
``refresh_trainable``) or on the first sync with a new wire dtype; later steps allocate
nothing.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._dist import global_rank
from oss_plus._layout import (
    Bucket,
    Gather,
    Key,
    Plan,
    Transport,
    alignment,
    bucket_numel,
    lay_out,
    padded,
    plan,
)
from oss_plus.plan import Layout, ShardPlan, ShardPolicy

__all__ = [
    "Bucket",
    "BucketSync",
    "OrderedBucketSync",
    "ParamBroadcast",
    "Transport",
    "alignment",
    "bucket_numel",
    "build_sync",
    "wire_dtype_for",
]

logger = logging.getLogger(__name__)

#: Floating dtypes that may travel compressed, and the wire dtypes allowed.
WIRE_DTYPES = (torch.float16, torch.bfloat16)
#: Environment variable overriding ``transport="auto"``: broadcast or all_gather.
TRANSPORT_ENV = "OSS_PLUS_SYNC"
#: Raised for an unknown transport name.
BAD_TRANSPORT = "{where} must be one of 'auto', 'broadcast' or 'all_gather', got {value!r}"

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wire_dtype_for(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype | None:
    """Return the dtype a buffer of ``dtype`` travels as, or None when it goes uncompressed.

    Only floating dtypes wider than ``wire`` are compressed: bf16/fp16 params are never
    upcast, integer params are never touched.

    Example:
        >>> wire_dtype_for(torch.float32, torch.bfloat16)
        torch.bfloat16
        >>> wire_dtype_for(torch.bfloat16, torch.float16) is None
        True
    """
    if wire is None or not dtype.is_floating_point or dtype.itemsize <= wire.itemsize:
        return None
    return wire


def _requested(transport: Transport | str) -> Transport:
    try:
        value = Transport(transport)
    except ValueError:
        raise ValueError(BAD_TRANSPORT.format(where="transport", value=transport)) from None
    env = os.environ.get(TRANSPORT_ENV, "")
    if value is Transport.AUTO and env:
        try:
            value = Transport(env)
        except ValueError:
            raise ValueError(BAD_TRANSPORT.format(where=TRANSPORT_ENV, value=env)) from None
    return value


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


class BucketSync:
    """Flat per-owner buckets whose views are the parameters, and the collectives that sync them.

    Args:
        params_by_owner: for every group-local rank, the params it owns (any order; frozen
            ones are skipped, the rest are laid out in ascending element count, stable).
        group: the process group.
        aligned: start every param at an allocator-aligned offset (default). fairscale packs
            params back to back; its compatibility layer passes False to match it.
        transport: ``"auto"`` (default), ``"broadcast"`` or ``"all_gather"``; see the
            module docstring.

    Raises:
        ValueError: unknown ``transport`` (or value of :data:`TRANSPORT_ENV`).

    Example:
        >>> sync = BucketSync([params_of_rank0, params_of_rank1], group)  # doctest: +SKIP
        >>> inner.step(); sync.sync(torch.bfloat16)  # doctest: +SKIP

    .. warning:: Collective: construct on every rank of ``group``.
    """

    def __init__(
        self,
        params_by_owner: Sequence[Sequence[torch.Tensor]],
        group: Any,
        aligned: bool = True,
        transport: Transport | str = Transport.AUTO,
    ) -> None:
        self.group = group
        self.aligned = aligned
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.buckets: list[Bucket] = []
        self._gathers: list[Gather] = []
        layout = plan(params_by_owner)
        gathered = self._gather_keys(layout, _requested(transport))
        self._allocate(layout, gathered)
        self._ptrs = self._current_ptrs()

    # ----------------------------------------------------------------- building the layout
    def _gather_keys(self, layout: Plan, requested: Transport) -> list[Key]:
        keys = list(dict.fromkeys(key for _, key, _ in layout))
        if requested is Transport.ALL_GATHER:
            return keys
        if requested is Transport.AUTO and self.world_size > 1 and "nccl" in _backend(self.group):
            return [k for k in keys if not k[0].startswith("cpu")]
        return []

    @torch.no_grad()
    def _allocate(self, layout: Plan, gathered: list[Key]) -> None:
        regions: dict[Key, Gather] = {}
        for key in gathered:
            device = torch.device(key[0])
            largest = max(bucket_numel(m, self.aligned) for _, k, m in layout if k == key)
            region = padded(largest, alignment(device, key[1]))
            regions[key] = Gather(
                torch.zeros(self.world_size * region, dtype=key[1], device=device), region
            )
        self._gathers = list(regions.values())
        for owner, key, members in layout:
            buffer, via = None, Transport.BROADCAST
            if key in regions:
                region = regions[key].region
                buffer, via = (
                    regions[key].flat[owner * region : (owner + 1) * region],
                    Transport.ALL_GATHER,
                )
            bucket = self._make_bucket(owner, members, self.aligned, buffer)
            bucket.via = via
            self.buckets.append(bucket)

    @staticmethod
    def _make_bucket(
        owner: int,
        params: list[torch.Tensor],
        aligned: bool,
        buffer: torch.Tensor | None = None,
        copy: bool = True,
    ) -> Bucket:
        """Lay ``params`` out in ``buffer`` (a new zeroed one by default); they become views."""
        return lay_out(owner, params, aligned, buffer, copy)

    def _current_ptrs(self) -> list[int]:
        return [p.data_ptr() for b in self.buckets for p in b.params]

    # ----------------------------------------------------------------- inspection
    def is_intact(self) -> bool:
        """Return False when a param stopped being a view of its bucket (``.data`` replaced,
        ``module.to(...)``): the layout must then be rebuilt."""
        return self._current_ptrs() == self._ptrs

    def transports(self) -> dict[str, int]:
        """Return how many buckets use each transport, e.g. ``{"broadcast": 2}``."""
        counts: dict[str, int] = {}
        for b in self.buckets:
            counts[b.via.value] = counts.get(b.via.value, 0) + 1
        return counts

    def wire_bytes(self, wire: torch.dtype | None = None) -> int:
        """Return the bytes one :meth:`sync` moves: every bucket once (alignment padding
        included; every rank's region for ``all_gather``), whether this rank sends or
        receives it."""
        total = 0
        for g in self._gathers:
            total += g.flat.numel() * (wire_dtype_for(g.flat.dtype, wire) or g.flat.dtype).itemsize
        for b in self.buckets:
            if b.via is Transport.BROADCAST:
                dtype = wire_dtype_for(b.buffer.dtype, wire) or b.buffer.dtype
                total += b.buffer.numel() * dtype.itemsize
        return total

    @torch.no_grad()
    def release(self) -> None:
        """Give every bucketed param its own storage again (before a layout is dropped)."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.data = p.data.clone()
        self.buckets, self._gathers, self._ptrs = [], [], []

    # ----------------------------------------------------------------- syncing
    @torch.no_grad()
    def sync(self, wire: torch.dtype | None = None) -> None:
        """Bring every replica up to date with the owners' buckets; compress with ``wire``.

        .. warning:: Collective: call on every rank of ``group``.
        """
        with torch.profiler.record_function("oss_plus::sync"):
            pending = self._start_gathers(wire) + self._start_broadcasts(wire)
            with torch.profiler.record_function("oss_plus::sync.wait"):
                for finish in pending:
                    finish()

    def _start_gathers(self, wire: torch.dtype | None) -> list[Callable[[], None]]:
        pending: list[Callable[[], None]] = []
        for g in self._gathers:
            dtype = wire_dtype_for(g.flat.dtype, wire)
            out = g.flat if dtype is None else g.wire_buffer(dtype)
            mine = out[self.rank * g.region : (self.rank + 1) * g.region]
            if dtype is not None:
                mine.copy_(g.flat[self.rank * g.region : (self.rank + 1) * g.region])
            work = _all_gather_single(out, mine, group=self.group, async_op=True)
            pending.append(functools.partial(self._finish_gather, work, g, out, dtype))
        return pending

    def _finish_gather(
        self, work: Any, g: Gather, out: torch.Tensor, dtype: torch.dtype | None
    ) -> None:
        work.wait()
        if dtype is not None:  # widen every region but this rank's own (kept exact)
            start, end = self.rank * g.region, (self.rank + 1) * g.region
            g.flat[:start].copy_(out[:start])
            g.flat[end:].copy_(out[end:])

    def _start_broadcasts(self, wire: torch.dtype | None) -> list[Callable[[], None]]:
        return [
            self._broadcast_bucket(bucket, wire)
            for bucket in self.buckets
            if bucket.via is Transport.BROADCAST
        ]

    def _broadcast_bucket(self, bucket: Bucket, wire: torch.dtype | None) -> Callable[[], None]:
        """Start the async broadcast of ``bucket`` from its owner (through a compressed copy
        when ``wire`` narrows it); return the callable that waits and widens."""
        dtype = wire_dtype_for(bucket.buffer.dtype, wire)
        tensor = bucket.buffer if dtype is None else bucket.wire_buffer(dtype)
        if dtype is not None and bucket.owner == self.rank:
            tensor.copy_(bucket.buffer)
        src = global_rank(self.group, bucket.owner)
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        return functools.partial(self._finish_broadcast, work, bucket, tensor, dtype)

    def _finish_broadcast(
        self, work: Any, bucket: Bucket, tensor: torch.Tensor, dtype: torch.dtype | None
    ) -> None:
        work.wait()
        if dtype is not None and bucket.owner != self.rank:
            bucket.buffer.copy_(tensor)


class OrderedBucketSync(BucketSync):
    """torch's bucket views: each owner's trainable params back to back, in the given order.

    Args:
        params_by_owner: for every group-local rank, its params in partition order (frozen
            ones are skipped).
        group: the process group.
    """

    def __init__(self, params_by_owner: Sequence[Sequence[torch.Tensor]], group: Any) -> None:
        super().__init__([[] for _ in params_by_owner], group, aligned=False)
        for owner, params in enumerate(params_by_owner):
            by_key: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
            for p in params:
                if p.requires_grad:
                    by_key.setdefault((str(p.device), p.dtype), []).append(p)
            for members in by_key.values():
                self.buckets.append(self._make_bucket(owner, members, aligned=False))
        self._ptrs = self._current_ptrs()


class ParamBroadcast(BucketSync):
    """torch's default: one broadcast per param (frozen ones too), params keep their storage.

    Each "bucket" is a single param whose buffer is ``param.data`` itself, so nothing is
    copied and :meth:`release` has nothing to give back.

    Args:
        params_by_owner: for every group-local rank, its params in partition order.
        group: the process group.
    """

    def __init__(self, params_by_owner: Sequence[Sequence[torch.Tensor]], group: Any) -> None:
        super().__init__([[] for _ in params_by_owner], group, aligned=False)
        for owner, params in enumerate(params_by_owner):
            self.buckets.extend(Bucket(owner, p.data, [p]) for p in params)
        self._ptrs = self._current_ptrs()

    def release(self) -> None:
        """Drop the layout; params already own their storage."""
        self.buckets = []
        self._ptrs = []


def build_sync(
    params: Sequence[torch.Tensor], plan: ShardPlan, policy: ShardPolicy, group: Any
) -> BucketSync:
    """Build the sync of ``policy.layout`` for ``params`` (flat order) owned as in ``plan``.

    .. warning:: Collective: call on every rank of ``group``.
    """
    if policy.layout is Layout.OWNER_BUCKETS:
        by_owner = [[params[i] for i in plan.owned(r)] for r in range(plan.world_size)]
        return BucketSync(by_owner, group, aligned=policy.aligned, transport=policy.transport)
    by_local = [
        [params[i] for indices in plan.local_indices(r) for i in indices]
        for r in range(plan.world_size)
    ]
    if policy.layout is Layout.ORDERED_BUCKETS:
        return OrderedBucketSync(by_local, group)
    return ParamBroadcast(by_local, group)
