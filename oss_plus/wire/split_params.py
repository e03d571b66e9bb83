"""The params of a sync layout that span buckets (the flat rule), owned by
:class:`oss_plus.wire.sync.BucketSync`.

Under the flat rule every range of a (device, dtype) buffer is followed by its rank's status
slot (:func:`oss_plus.wire.layout.flat_buckets`), so a param cut by a range boundary cannot be a
view of the buffer: it keeps storage of its own, and each of its pieces is a view of the
range that holds it (:attr:`oss_plus.wire.layout.Bucket.pieces`). :class:`SplitParams` keeps the
two in step:

* before the local step, the pieces of this rank's own range take the params' values
  (:meth:`SplitParams.refresh`: what was written into a param in place since the last sync,
  a model's ``load_state_dict``, is what the owner steps, as for a param that is a view);
* the inner optimizer steps the piece (:meth:`SplitParams.view`, the tensor a
  :class:`~oss_plus.step.pieces.PieceTargets` points at), in the range that travels;
* when a bucket's transfer completes, its pieces are copied into their params
  (:meth:`SplitParams.fill`; one ``torch._foreach_copy_``): every rank, the owner included,
  then holds in the param what travelled.

At most ``world_size - 1`` params per (device, dtype) span ranges, and a range holds pieces
of at most two of them unless one param spans it whole: the copies per step do not grow with
the number of params.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from oss_plus.wire.layout import Bucket

__all__ = ["SplitParams"]


class SplitParams:
    """The pieces of the params that span the buckets of one layout.

    Args:
        buckets: the layout's buckets (only their :attr:`~oss_plus.wire.layout.Bucket.pieces`
            are read).
        rank: this rank (whose bucket's pieces it steps).
    """

    def __init__(self, buckets: Sequence[Bucket], rank: int) -> None:
        #: for ``id(bucket)``: its pieces as (param slices, bucket views)
        self._copies: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}
        self._mine: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        #: for ``id(param)``: the buckets holding its pieces
        self.holding: dict[int, list[Bucket]] = {}
        for bucket in buckets:
            if not bucket.pieces:
                continue
            slices = [p.data.view(-1)[start : start + v.numel()] for p, start, v in bucket.pieces]
            views = [v for _, _, v in bucket.pieces]
            self._copies[id(bucket)] = (slices, views)
            for (p, start, view), part in zip(bucket.pieces, slices):
                self.holding.setdefault(id(p), []).append(bucket)
                if bucket.owner == rank:
                    self._views[(id(p), start, start + view.numel())] = view
                    self._mine[0].append(part)
                    self._mine[1].append(view)

    @property
    def stepping(self) -> bool:
        """Whether this rank steps pieces of params that span buckets (:meth:`refresh` has
        work to do)."""
        return bool(self._mine[0])

    def view(self, param: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """This rank's piece ``[start, end)`` of ``param`` in its bucket, or None when
        ``param`` does not span buckets there (its piece is then a view of the param)."""
        return self._views.get((id(param), start, end))

    @torch.no_grad()
    def refresh(self) -> None:
        """Before the local step: this rank's pieces take their params' values."""
        if self._mine[0]:
            torch._foreach_copy_(self._mine[1], self._mine[0])

    @torch.no_grad()
    def fill(self, buckets: Iterable[Bucket]) -> None:
        """After the transfer of ``buckets``: their pieces go into their params."""
        params: list[torch.Tensor] = []
        views: list[torch.Tensor] = []
        for bucket in buckets:
            copies = self._copies.get(id(bucket))
            if copies is not None:
                params += copies[0]
                views += copies[1]
        if params:
            torch._foreach_copy_(params, views)
