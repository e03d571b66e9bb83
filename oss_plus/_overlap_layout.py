"""The parameter layout of the overlapped step: one flat buffer per (DDP bucket, owner).

:class:`OverlapSync` is a :class:`oss_plus.sync.BucketSync` whose buckets ("pieces") follow
DDP's gradient buckets: for DDP bucket ``b`` and each rank ``r`` stepping params of ``b``, the
params ``r`` steps are laid out back to back at aligned offsets (bit-identical kernels) in one
buffer whose views are the params. After ``r`` stepped them, one broadcast from ``r`` brings
them to every rank, so bucket ``b``'s params travel while DDP still reduces later buckets.

Pieces are built lazily, per DDP bucket, the first time its gradients arrive (or again when
DDP rebuilds its buckets: the params of a changed bucket leave their old pieces first). As a
``BucketSync``, the layout still supports a plain :meth:`sync` of every piece (what the core
``step()`` calls), :meth:`release`, :meth:`is_intact` and :meth:`wire_bytes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.sync import Bucket, BucketSync

__all__ = ["Entry", "OverlapSync", "make_entry"]

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


class OverlapSync(BucketSync):
    """Pieces laid out per (DDP bucket, stepping rank); see the module docstring.

    Args:
        group: the optimizer's process group (pieces are broadcast on it).

    .. warning:: Collective: construct on every rank of ``group``.
    """

    def __init__(self, group: Any) -> None:
        super().__init__(
            [[] for _ in range(dist.get_world_size(group))], group, transport="broadcast"
        )
        self.entries: dict[int, Entry] = {}
        self._warned = False

    def entry(self, index: int, params: Sequence[torch.Tensor], planner: PiecePlanner) -> Entry:
        """Return the pieces of DDP bucket ``index``, laying them out if it is new or changed."""
        ids = tuple(id(p) for p in params)
        known = self.entries.get(index)
        if known is not None and known.ids == ids:
            return known
        return self._lay_out(index, params, ids, planner(params))

    @torch.no_grad()
    def _lay_out(
        self,
        index: int,
        params: Sequence[torch.Tensor],
        ids: tuple[int, ...],
        plan: list[tuple[int, list[int]]],
    ) -> Entry:
        members = set(ids)
        stale = [
            k
            for k, e in self.entries.items()
            if k == index or any(id(p) in members for b in e.pieces for p in b.params)
        ]
        for k in stale:
            self._drop(self.entries.pop(k))
        pieces = [
            self._make_bucket(owner, [params[i] for i in where], True) for owner, where in plan
        ]
        entry = make_entry(ids, params, plan, self.rank, pieces)
        self.entries[index] = entry
        self.buckets = [b for e in self.entries.values() for b in e.pieces]
        self._ptrs = self._current_ptrs()
        logger.debug(
            "DDP bucket %d: %d piece(s), %d param(s) stepped here",
            index,
            len(pieces),
            len(entry.owned),
        )
        return entry

    @staticmethod
    def _drop(entry: Entry) -> None:
        """Give the params of ``entry`` that are still views of its pieces their own storage."""
        for piece in entry.pieces:
            start = piece.buffer.data_ptr()
            end = start + piece.buffer.numel() * piece.buffer.element_size()
            for p in piece.params:
                if start <= p.data_ptr() < end:
                    p.data = p.data.clone()

    def release(self) -> None:
        """Give every param its own storage again and forget every piece."""
        super().release()
        self.entries = {}

    def broadcast(self, entry: Entry, wire: torch.dtype | None) -> list[Callable[[], None]]:
        """Start one async broadcast per piece of ``entry`` from its owner.

        Args:
            entry: the DDP bucket whose pieces were stepped (on their owners).
            wire: compress floating buffers wider than this dtype on the wire (None: don't).

        Returns:
            Callables that wait for each broadcast (and widen a compressed copy).

        .. warning:: Collective: call on every rank of ``group``, bucket by bucket in order.
        """
        return [self._broadcast_bucket(piece, wire) for piece in entry.pieces]

    def sync(self, wire: torch.dtype | None = None) -> None:
        """Broadcast every piece (what ``OSS.step()`` calls); warns once, see
        :data:`STEP_WHILE_OVERLAPPED`.

        .. warning:: Collective: call on every rank of ``group``.
        """
        if not self._warned:
            logger.warning(STEP_WHILE_OVERLAPPED)
            self._warned = True
        with torch.no_grad():
            pending = [f for e in self.entries.values() for f in self.broadcast(e, wire)]
            for finish in pending:
                finish()
