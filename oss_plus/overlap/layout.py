"""The parameter layout of the overlapped step: one flat buffer per (DDP bucket, owner).

:class:`PieceLayout` (no collectives) lays the params out in "pieces" that follow DDP's
gradient buckets: for DDP bucket ``b`` and each rank ``r`` stepping params of ``b``, the
params ``r`` steps are laid out back to back at aligned offsets (bit-identical kernels) in one
buffer whose views are the params, followed by the status slot of :mod:`oss_plus.wire.layout`.
Pieces are built lazily, per DDP bucket, the first time its gradients arrive (or again when
DDP rebuilds its buckets: the params of a changed bucket leave their old pieces first).

:class:`OverlapSync` is what the overlap installs as the optimizer's sync
(:meth:`oss_plus.OSS.install_sync`): the piece layout plus a
:class:`oss_plus.wire.sync.BucketSync` over its pieces, which moves the bytes. After ``r`` stepped
its piece of bucket ``b``, one broadcast from ``r`` brings it to every rank, so bucket ``b``'s
params travel while DDP still reduces later buckets. It also supports a plain :meth:`sync`
of every piece (what the core ``step()`` calls), :meth:`release`, :meth:`is_intact` and
:meth:`wire_bytes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.wire.layout import Bucket, lay_out
from oss_plus.wire.main.region import carry_main_values, main_values
from oss_plus.wire.sync import BucketSync, Pending

__all__ = ["Entry", "OverlapSync", "PieceLayout", "make_entry"]

logger = logging.getLogger(__name__)

#: Plans one DDP bucket: its params -> ``(owner, positions in the bucket)`` per piece.
PiecePlanner = Callable[[Sequence[torch.Tensor]], list[tuple[int, list[int]]]]
#: Logged once when the core ``step()`` syncs this layout (the step already ran in backward).
STEP_WHILE_OVERLAPPED = (
    "step() was called on an optimizer whose step runs inside DDP's backward "
    "(oss_plus.overlap): this applied a second update; remove the step() call"
)


@dataclass
class Entry:
    """The pieces of one DDP bucket and what this rank steps in it.

    Attributes:
        ids: ``id()`` of the bucket's params, in bucket order (to notice DDP rebuilds).
        pieces: one flat buffer per stepping rank, in plan order.
        owned: the params this rank steps, in bucket order.
        positions: their positions in the bucket (index into ``GradBucket.gradients()``).
    """

    ids: tuple[int, ...]
    pieces: list[Bucket]
    owned: list[torch.Tensor]
    positions: list[int]
    _groups: tuple[Any, list[list[torch.Tensor]]] | None = field(default=None, repr=False)

    def groups_for(self, inner: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        """Return, per param group of ``inner``, its params among :attr:`owned` (cached)."""
        key = (id(inner), tuple(len(g["params"]) for g in inner.param_groups))
        if self._groups is None or self._groups[0] != key:
            owned = {id(p) for p in self.owned}
            groups = [[p for p in g["params"] if id(p) in owned] for g in inner.param_groups]
            if sum(len(g) for g in groups) != len(self.owned):
                raise RuntimeError(
                    "a param this rank steps in a DDP bucket is not in its local optimizer: "
                    "the partition changed under the overlapped step"
                )
            self._groups = (key, groups)
        return self._groups[1]


def make_entry(
    ids: tuple[int, ...],
    params: Sequence[torch.Tensor],
    plan: list[tuple[int, list[int]]],
    rank: int,
    pieces: list[Bucket],
) -> Entry:
    """Return the :class:`Entry` of a bucket planned as ``plan`` (``(owner, positions)``)."""
    positions = sorted(i for owner, where in plan if owner == rank for i in where)
    return Entry(ids, pieces, [params[i] for i in positions], positions)


class PieceLayout:
    """The pieces of every DDP bucket seen so far (no collectives; see the module docstring).

    Args:
        rank: this rank in the optimizer's group.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.entries: dict[int, Entry] = {}
        self._carried: dict[int, torch.Tensor] = {}

    def find(self, index: int, params: Sequence[torch.Tensor]) -> Entry | None:
        """Return the entry of DDP bucket ``index`` if it holds exactly ``params``."""
        known = self.entries.get(index)
        return known if known is not None and known.ids == tuple(id(p) for p in params) else None

    @torch.no_grad()
    def add(
        self, index: int, params: Sequence[torch.Tensor], plan: list[tuple[int, list[int]]]
    ) -> Entry:
        """Lay out DDP bucket ``index`` as ``plan`` (``(owner, positions)`` per piece); the
        params of a changed bucket leave their old pieces first."""
        ids = tuple(id(p) for p in params)
        members = set(ids)
        stale = [
            k
            for k, e in self.entries.items()
            if k == index or any(id(p) in members for b in e.pieces for p in b.params)
        ]
        # exact values of what this rank sent compressed, until their params are laid out
        self._carried.update(main_values([b for k in stale for b in self.entries[k].pieces]))
        for k in stale:
            _drop(self.entries.pop(k))
        pieces = [lay_out(owner, [params[i] for i in where], True) for owner, where in plan]
        carry_main_values(pieces, self._carried)
        entry = make_entry(ids, params, plan, self.rank, pieces)
        self.entries[index] = entry
        logger.debug(
            "DDP bucket %d: %d piece(s), %d param(s) stepped here",
            index,
            len(pieces),
            len(entry.owned),
        )
        return entry

    def buckets(self) -> list[Bucket]:
        """Every piece, bucket by bucket (the same order on every rank)."""
        return [b for e in self.entries.values() for b in e.pieces]


def _drop(entry: Entry) -> None:
    """Give the params of ``entry`` that are still views of its pieces their own storage."""
    for piece in entry.pieces:
        start = piece.buffer.data_ptr()
        end = start + piece.buffer.numel() * piece.buffer.element_size()
        for p in piece.params:
            if start <= p.data_ptr() < end:
                p.data = p.data.clone()


class OverlapSync:
    """The optimizer's sync while its step runs inside DDP's hook: pieces and their transport.

    Args:
        group: the optimizer's process group (pieces are broadcast on it).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.layout = PieceLayout(dist.get_rank(group))
        self.transport = BucketSync([], group)
        self._warned = False

    @property
    def buckets(self) -> list[Bucket]:
        """Every piece laid out so far."""
        return self.transport.buckets

    def entry(self, index: int, params: Sequence[torch.Tensor], planner: PiecePlanner) -> Entry:
        """Return the pieces of DDP bucket ``index``, laying them out if it is new or changed."""
        known = self.layout.find(index, params)
        if known is not None:
            return known
        entry = self.layout.add(index, params, planner(params))
        self.transport = BucketSync(self.layout.buckets(), self.group)
        return entry

    def broadcast(
        self, entry: Entry, wire: torch.dtype | None, failed: bool = False
    ) -> list[Pending]:
        """Start one async broadcast per piece of ``entry`` from its owner.

        Args:
            entry: the DDP bucket whose pieces were stepped (on their owners).
            wire: compress floating buffers wider than this dtype on the wire (None: don't).
            failed: this rank's step raised (its pieces carry the status).

        Returns:
            Callables that wait for each broadcast (and widen a compressed copy), with the
            tensors each holds (for :func:`oss_plus.runtime.dist.await_release`).

        .. warning:: Collective: call on every rank of ``group``, bucket by bucket in order.
        """
        return self.transport.start(entry.pieces, wire, failed)

    def settle(self, error: BaseException | None, entries: Sequence[Entry]) -> None:
        """After the broadcasts of ``entries`` completed: raise on every rank if any failed.

        .. warning:: Collective: call on every rank of ``group``.
        """
        self.transport.settle(error, [b for e in entries for b in e.pieces])

    def is_intact(self) -> bool:
        """See :meth:`oss_plus.wire.sync.BucketSync.is_intact`."""
        return self.transport.is_intact()

    def transports(self) -> dict[str, int]:
        """See :meth:`oss_plus.wire.sync.BucketSync.transports`."""
        return self.transport.transports()

    def wire_bytes(self, wire: torch.dtype | None = None) -> int:
        """See :meth:`oss_plus.wire.sync.BucketSync.wire_bytes`."""
        return self.transport.wire_bytes(wire)

    def release(self) -> None:
        """Give every param its own storage again and forget every piece."""
        self.transport.release()
        self.layout = PieceLayout(self.layout.rank)

    def sync(self, wire: torch.dtype | None = None, error: BaseException | None = None) -> None:
        """Broadcast every piece (what ``OSS.step()`` calls); warns once, see
        :data:`STEP_WHILE_OVERLAPPED`.

        .. warning:: Collective: call on every rank of ``group``.
        """
        if not self._warned:
            logger.warning(STEP_WHILE_OVERLAPPED)
            self._warned = True
        self.transport.sync(wire, error)
