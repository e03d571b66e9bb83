"""Parameter synchronisation after the local step: the transfer of ready-made bucket layouts
(:mod:`oss_plus.wire.layout`) from their owners, with wire compression and the step status.

:class:`BucketSync` receives the buckets of a layout and only moves their bytes; which
layout a :class:`~oss_plus.planning.plan.ShardPolicy` asks for is decided by
:func:`oss_plus.wire.factory.build_sync`, and
which transport each bucket uses by :mod:`oss_plus.wire.transport` (``broadcast`` from the owner,
or one ``all_gather`` per (device, dtype)). The status each owner sends in its buckets is
:mod:`oss_plus.wire.status`.

Every byte moves through ``torch.distributed`` collectives on the optimizer's group: oss_plus
writes no transport of its own (a shared-memory path measured faster on one host, but it is
a transport of our own that only works on one host, and it was removed).

Compression (fp16/bf16 wire): the owner rounds its region into a preallocated wire buffer,
sent instead, and rounds its own region the same way (receivers widen): every replica holds
the same values. Its exact values stay in a main copy (:mod:`oss_plus.wire.main.region`) that its
inner optimizer steps (:meth:`BucketSync.restore`, :mod:`oss_plus.wire.main.step`).

World size 1: nothing travels, so :func:`~oss_plus.wire.factory.build_sync` lays nothing
out (params keep their own storage; the adapters' policies keep their anchors' layout,
``single_rank_layout``) and a sync sends nothing, allocates no wire buffer and reads nothing
on the host: it only re-raises the local step's error.

Buffers are allocated when the layout is built (construction, ``add_param_group``,
``refresh_trainable``) or, for the wire copies, on the first sync with a new wire dtype, and
only for buckets that travel; later steps allocate nothing but the status read's few bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label
from oss_plus.wire.changes import Addresses
from oss_plus.wire.inflight import InFlight, Pending, holding_buckets
from oss_plus.wire.layout import Bucket, Gather, Transport, alignment, bucket_numel
from oss_plus.wire.main.copies import MainCopies
from oss_plus.wire.main.step import Plans, Redirect
from oss_plus.wire.split_params import SplitParams
from oss_plus.wire.status import FAILED, OK, PeerSlots, any_set
from oss_plus.wire.transport import (
    BAD_TRANSPORT,
    TRANSPORT_ENV,
    gathered_keys,
    transport_override,
    wire_dtype_for,
)

__all__ = [
    "Bucket",
    "BucketSync",
    "Transport",
    "alignment",
    "BAD_TRANSPORT",
    "TRANSPORT_ENV",
    "any_set",
    "bucket_numel",
    "gathered_keys",
    "transport_override",
    "wire_dtype_for",
]

logger = logging.getLogger(__name__)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BucketSync:
    """Moves the bytes of ready-made buckets from their owners to every rank.

    Args:
        buckets: the layout's buckets (:mod:`oss_plus.wire.layout`), in the same order on every
            rank; those with ``via == "broadcast"`` are broadcast one by one.
        group: the process group.
        gathers: the ``all_gather`` buffers the other buckets are views of.

    Example:
        >>> buckets, gathers = owner_buckets(params_by_owner, aligned=True)  # doctest: +SKIP
        >>> sync = BucketSync(buckets, group, gathers)  # doctest: +SKIP
        >>> inner.step(); sync.launch(torch.bfloat16, OK).wait()  # doctest: +SKIP
    """

    def __init__(
        self, buckets: Sequence[Bucket], group: Any, gathers: Sequence[Gather] = ()
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.buckets = list(buckets)
        self.gathers = list(gathers)
        self._broadcast = [b for b in self.buckets if b.via is Transport.BROADCAST]
        # looked up once: both cost microseconds of Python per call, at every step
        self._releases_late = _dist.releases_late(group)
        self._sources = [_dist.global_rank(group, r) for r in range(self.world_size)]
        #: where this rank finds its peers' status codes after a sync
        self.status = PeerSlots(self.buckets, self.gathers, group)
        self._addresses = Addresses([p for b in self.buckets for p in b.params])
        #: the params that span buckets (the flat rule) and their pieces
        self.splits = SplitParams(self.buckets, self.rank)
        #: the main copies of the regions this rank sends compressed
        #: (:mod:`oss_plus.wire.main.region`)
        self.mains = MainCopies.of(
            self._broadcast, self.gathers, self.rank, self._addresses.tensors
        )
        self._holding: dict[int, list[Bucket]] | None = None
        self._plans = Plans()  # which stepped tensors step which main copy
        #: how long a wait for one transfer may take before it raises (gloo only: NCCL's
        #: wait does not block the host, its watchdog has the group's timeout); None: as
        #: long as the group's timeout
        self.timeout: timedelta | None = None

    # ----------------------------------------------------------------- inspection
    def is_intact(self) -> bool:
        """Return False when a param stopped being a view of its bucket (``.data`` replaced,
        ``module.to(...)``): the layout must then be rebuilt.

        One address read per bucketed param, at C speed (:class:`oss_plus.wire.changes.Addresses`).
        """
        return self._addresses.intact()

    def transports(self) -> dict[str, int]:
        """Return how many buckets use each transport, e.g. ``{"broadcast": 2}``."""
        counts: dict[str, int] = {}
        for b in self.buckets:
            counts[b.via.value] = counts.get(b.via.value, 0) + 1
        return counts

    def wire_bytes(self, wire: torch.dtype | None = None) -> int:
        """Return the bytes one :meth:`sync` moves: every bucket once (alignment padding and
        status slots included; every rank's region for ``all_gather``), whether this rank
        sends or receives it."""
        flats = [g.flat for g in self.gathers] + [b.flat for b in self._broadcast]
        return sum(
            f.numel() * (wire_dtype_for(f.dtype, wire) or f.dtype).itemsize
            for f in flats
            if f is not None
        )

    def holding(self) -> dict[int, list[Bucket]]:
        """For ``id(param)`` of every bucketed param, the buckets holding its memory
        (:func:`oss_plus.wire.inflight.holding_buckets`); once per layout."""
        if self._holding is None:
            params = self._addresses.tensors
            self._holding = holding_buckets(self.buckets, self.splits.holding, params)
        return self._holding

    def main_bytes(self) -> int:
        """Return the bytes the main copies of this rank hold (:mod:`oss_plus.wire.main.region`:
        the regions it sends compressed, in their dtype)."""
        return self.mains.nbytes()

    def compressed_numel(self, wire: torch.dtype | None) -> int:
        """Return the elements this rank sends compressed with ``wire`` (its regions whose
        dtype the wire narrows, status slots and alignment included): what its main copies
        hold once it sent them."""
        return sum(
            r.numel() for _, r in self.mains.regions if wire_dtype_for(r.dtype, wire) is not None
        )

    def written(self) -> None:
        """Say that params were written in place through ``p.data`` (which moves no version
        counter) since the last step: the next step compares every element of the regions
        this rank sent compressed, so those writes are kept (``docs/amp.md``). Not
        collective; needed on the ranks that own written params (calling it on every rank
        is simplest)."""
        self.mains.written()

    @torch.no_grad()
    def release(self) -> None:
        """Give every bucketed param its own storage again (before a layout is dropped); the
        main copies go (the params keep the values every rank holds)."""
        self.mains.drop()
        for bucket in self.buckets:
            if bucket.views:
                for p in bucket.params:
                    p.data = p.data.clone()
        self.buckets, self.gathers, self._broadcast = [], [], []
        self._addresses, self.status = Addresses([]), PeerSlots([], [], self.group)
        self.mains = MainCopies([], [])
        self.splits = SplitParams([], self.rank)

    def piece_view(self, param: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """Where this rank's piece ``[start, end)`` of a param that spans buckets lives (the
        tensor its inner optimizer steps), or None (see :mod:`oss_plus.wire.split_params`)."""
        return self.splits.view(param, start, end)

    # ----------------------------------------------------------------- syncing
    def restore(
        self,
        wire: torch.dtype | None,
        buckets: Sequence[Bucket] | None = None,
        stepped: Callable[[], Sequence[torch.Tensor]] | None = None,
    ) -> Redirect:
        """Before the local step: the pieces this rank steps of params that span buckets
        take the params' values (:meth:`oss_plus.wire.split_params.SplitParams.refresh`); then
        the regions this rank sent compressed get their exact values back
        (:meth:`oss_plus.wire.main.region.MainCopy.restore`; of ``buckets`` only when given). A
        region that will travel uncompressed with ``wire`` drops its copy. With
        ``stepped()`` (the tensors the inner optimizer steps), a region still compressed
        returns them pointed at its main values instead (:mod:`oss_plus.wire.main.step`: enter
        the result around the local step). Not collective."""
        if not self.splits.stepping and not self.mains.held:
            return Redirect()  # nothing to refresh or restore: the usual step, no no_grad
        with torch.no_grad():
            self.splits.refresh()
            keys = None if buckets is None else {id(b) for b in buckets}
            compressed = functools.partial(_compressed, wire=wire)
            return self._plans.restore(self.mains, compressed, keys, stepped)

    def launch(self, wire: torch.dtype | None, code: int = OK) -> InFlight:
        """Start bringing every replica up to date with the owners' buckets; compress with
        ``wire``; send this rank's status ``code`` (:mod:`oss_plus.wire.status`) with them.

        Returns without waiting: :meth:`InFlight.wait` waits (not collective) and stages the
        peers' codes for :class:`oss_plus.wire.status.StepStatus` (nothing is read at once). At
        world size 1 nothing travels: an :class:`InFlight` with nothing to wait for. No
        ``no_grad`` (several microseconds per step): it writes only buffers no autograd
        graph holds (buckets, wire buffers, main copies; as :meth:`start` always did).

        .. warning:: Collective: call on every rank of ``group``.
        """
        if self.world_size == 1:
            return InFlight([], {}, None, self.group, release=False)
        with label("oss_plus::sync"):
            pending, covers = self._start_gathers(wire, code)
            vector = self.status.send_vector(code)
            if vector is not None:
                work, tensors = vector
                held = list(zip(tensors, _dist.use_counts(tensors)))
                pending.append(Pending(functools.partial(_wait, work, self._bound()), held))
            for bucket, transfer in zip(self._broadcast, self.start(self._broadcast, wire, code)):
                pending.append(transfer)
                covers[id(bucket)] = transfer
        return InFlight(pending, covers, self.status, self.group, release=self._releases_late)

    @torch.no_grad()
    def sync(self, wire: torch.dtype | None = None, error: BaseException | None = None) -> None:
        """Launch, wait, and check at once (:meth:`settle`): raise on every rank if any
        rank's step raised. The core's step uses :meth:`launch` and checks later.

        .. warning:: Collective: call on every rank of ``group``.
        """
        self.launch(wire, OK if error is None else FAILED).wait()
        self.settle(error)

    def settle(self, error: BaseException | None, buckets: Sequence[Bucket] | None = None) -> None:
        """After the waits: raise on every rank if any rank's step raised (one device-to-host
        read of the peers' slots of ``buckets``, default: of this layout; see
        :meth:`oss_plus.wire.status.PeerSlots.settle`).

        .. warning:: Collective: call on every rank of ``group`` after the same sends.
        """
        self.status.settle(error, buckets)

    def _start_gathers(
        self, wire: torch.dtype | None, code: int
    ) -> tuple[list[Pending], dict[int, Pending]]:
        pending: list[Pending] = []
        covers: dict[int, Pending] = {}
        for g in self.gathers:
            if g.slots and g.status != code:  # the slot keeps its value between syncs
                g.slot(self.rank).fill_(float(code))
                g.status = code
            dtype = wire_dtype_for(g.flat.dtype, wire)
            out = g.flat if dtype is None else g.wire_buffer(dtype)
            mine = out[self.rank * g.region : (self.rank + 1) * g.region]
            if dtype is not None:
                region = g.flat[self.rank * g.region : (self.rank + 1) * g.region]
                self.mains.send(g, region, mine, g.slot(self.rank) if g.slots else None)
            held = list(zip((out, mine), _dist.use_counts((out, mine))))
            key = (g.flat.device, g.flat.dtype)
            brought = [  # one gather per (device, dtype) brings all its buckets
                b
                for b in self.buckets
                if b.via is Transport.ALL_GATHER and (b.buffer.device, b.buffer.dtype) == key
            ]
            work = _all_gather_single(out, mine, group=self.group, async_op=True)
            finish = functools.partial(self._finish_gather, work, g, out, dtype, brought)
            transfer = Pending(finish, held)
            pending.append(transfer)
            covers.update((id(b), transfer) for b in brought)
        self.mains.widen()  # this rank's regions, while the gathers run
        return pending, covers

    def _finish_gather(
        self,
        work: Any,
        g: Gather,
        out: torch.Tensor,
        dtype: torch.dtype | None,
        brought: Sequence[Bucket],
    ) -> None:
        _wait(work, self._bound())
        if dtype is not None:  # every region but this rank's own (widened at the launch)
            start, end = self.rank * g.region, (self.rank + 1) * g.region
            g.flat[:start].copy_(out[:start])
            g.flat[end:].copy_(out[end:])
        self.splits.fill(brought)

    def start(
        self, buckets: Sequence[Bucket], wire: torch.dtype | None, failed: int = OK
    ) -> list[Pending]:
        """Start the async broadcast of every bucket from its owner (through a compressed
        copy when ``wire`` narrows it); the owner first writes its status code ``failed``
        (:mod:`oss_plus.wire.status`; True means :data:`~oss_plus.wire.status.FAILED`) in its slot.

        Returns:
            The transfers (call one to wait for it and widen a compressed copy); none at
            world size 1, where nothing travels (and no wire buffer is allocated).

        .. warning:: Collective: call on every rank of ``group`` with the same buckets.
        """
        if self.world_size == 1:
            return []
        try:
            return [self._broadcast_bucket(b, wire, int(failed)) for b in buckets]
        finally:  # this rank's regions, while the broadcasts run (also if one raised)
            self.mains.widen()

    def _broadcast_bucket(self, bucket: Bucket, wire: torch.dtype | None, code: int) -> Pending:
        flat = bucket.flat
        assert flat is not None
        mine = bucket.owner == self.rank
        slot = bucket.slot
        if mine and slot is not None and bucket.status != code:
            slot.fill_(float(code))  # the slot keeps its value between syncs
            bucket.status = code
        dtype = wire_dtype_for(flat.dtype, wire)
        tensor = flat if dtype is None else bucket.wire_buffer(dtype)
        if dtype is not None and mine:
            self.mains.send(bucket, flat, tensor, slot)
        src = self._sources[bucket.owner]
        held = list(zip([tensor], _dist.use_counts([tensor])))
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        fill = functools.partial(self.splits.fill, (bucket,)) if bucket.pieces else None
        widen = dtype is not None and not mine
        finish = functools.partial(
            _finish_broadcast, work, flat, tensor, widen, fill, self._bound()
        )
        return Pending(finish, held)

    def _bound(self) -> timedelta | None:
        return self.timeout if self._releases_late else None


def _wait(work: Any, timeout: timedelta | None) -> None:
    """Wait for ``work``; with a ``timeout``, raise RuntimeError after it (gloo's
    "Operation timed out!": the step's driver names where the ranks are)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def _compressed(dtype: torch.dtype, wire: torch.dtype | None) -> bool:
    return wire_dtype_for(dtype, wire) is not None


def _finish_broadcast(
    work: Any,
    flat: torch.Tensor,
    tensor: torch.Tensor,
    widen: bool,
    fill: Callable[[], None] | None,
    timeout: timedelta | None = None,
) -> None:
    _wait(work, timeout)
    if widen:
        flat.copy_(tensor)
    if fill is not None:
        fill()  # the pieces it holds of params that span buckets
