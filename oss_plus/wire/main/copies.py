"""The main copies of one rank: every region it sends on a compressed wire (issue 27).

:class:`MainCopies` finds the regions of a layout that this rank sends, gives each a
:class:`oss_plus.wire.main.region.MainCopy` when it first goes out compressed (kept on its holder,
a bucket or a gather, so another sync over the same holders finds it), and runs them
together: the send (round into the wire copies) and the widen once the transfers started,
the restore or the step of the main values before the next local step
(:mod:`oss_plus.wire.main.step`), the exact values for the state (:meth:`MainCopies.values`,
:meth:`MainCopies.load`), and writes through ``p.data`` (:meth:`MainCopies.written`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from oss_plus.wire.main.region import MainCopy, offset_in, overlaps

__all__ = ["MainCopies"]


class MainCopies:
    """The main copies of the regions one rank sends (owned by
    :class:`oss_plus.wire.sync.BucketSync`; the copies live on their holders, a bucket or a
    gather, so another sync over the same holders finds them).

    Args:
        regions: ``(holder, region)`` for every region this rank sends, ``holder.main``
            being its :class:`MainCopy` or None.
        params: every param of the layout (views of its buckets, or with storage of their
            own for those that span buckets).
        pieces: ``(param, view)`` for every piece of a param that spans buckets.
    """

    def __init__(
        self,
        regions: Sequence[tuple[Any, torch.Tensor]],
        params: Sequence[torch.Tensor],
        pieces: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        self.regions = list(regions)
        self._params = list(params)
        self._pieces = list(pieces)
        #: by ``id``: the holders with a main copy
        self.held = {id(h): h for h, _ in self.regions if h.main is not None}
        self._sending: list[MainCopy] = []  # sent, not yet widened (:meth:`widen`)

    @classmethod
    def of(
        cls, broadcast: Sequence[Any], gathers: Sequence[Any], rank: int, params: Sequence[Any]
    ) -> MainCopies:
        """The main copies of a layout: the regions ``rank`` sends are its ``broadcast``
        buckets and its range of every gather; ``params`` are the layout's params."""
        regions = [(b, b.flat) for b in broadcast if b.owner == rank and b.flat is not None]
        regions += [(g, g.flat[rank * g.region : (rank + 1) * g.region]) for g in gathers]
        pieces = [(p, view) for b in broadcast for p, _, view in b.pieces]  # slotted: broadcast
        return cls(regions, params, pieces)

    def _writers(self, region: torch.Tensor) -> list[torch.Tensor]:
        found = {id(p): p for p in self._params if overlaps(p, region)}
        found.update((id(p), p) for p, view in self._pieces if overlaps(view, region))
        return list(found.values())

    def _copy_of(self, holder: Any, region: torch.Tensor) -> MainCopy:
        main = holder.main
        if main is None or main.region.data_ptr() != region.data_ptr():
            main = holder.main = MainCopy(region, self._writers(region))
            self.held[id(holder)] = holder
        return main

    def send(self, holder: Any, region: torch.Tensor, sent: torch.Tensor, slot: Any = None) -> None:
        """Round ``region`` (``holder``'s, ``slot`` its status slot or None) into ``sent``,
        keeping its exact values; :meth:`widen` rounds the region itself, once the transfers
        of ``sent`` started."""
        main = self._copy_of(holder, region)
        main.send(sent, slot)
        self._sending.append(main)

    def widen(self) -> None:
        """Round every region sent since the last call the way its wire copy was
        (:meth:`MainCopy.widen`): call it after starting their transfers, before the
        transfers are waited for and before anything reads the params."""
        sending, self._sending = self._sending, []
        for main in sending:
            main.widen()

    def restore(self, compressed: Any, keys: set[int] | None = None, plan: Any = None) -> list[Any]:
        """Put the exact values back (of the holders of ``keys`` only, when given); drop the
        copies of regions that ``compressed(dtype)`` says no longer travel compressed.

        With ``plan`` (``plan(main)``: :func:`oss_plus.wire.main.step.redirects` or None), a
        region that still travels compressed and has a plan is not restored: its main copy
        takes the writes since the sync (:meth:`MainCopy.absorb`) and the plan's pairs are
        returned, for the inner optimizer to step the main values themselves."""
        pairs: list[Any] = []
        for key, holder in list(self.held.items()):
            main = holder.main
            if main is None or (keys is not None and key not in keys):
                continue
            keep = compressed(main.region.dtype)
            found = plan(main) if keep and plan is not None else None
            if found is not None:
                main.absorb()
                pairs += found
                continue
            main.restore()
            if not keep:
                holder.main = None
                del self.held[key]
        return pairs

    def written(self) -> None:
        """Compare every element at the next restore (see :meth:`MainCopy.written`)."""
        for holder in self.held.values():
            holder.main.written()

    def nbytes(self) -> int:
        """Bytes the main copies hold."""
        return sum(h.main.nbytes for h in self.held.values() if h.main is not None)

    def drop(self) -> None:
        """Forget every main copy."""
        for holder in self.held.values():
            holder.main = None
        self.held = {}

    def values(self, targets: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The exact values of the ``targets`` (by flat index: the tensors this rank's inner
        optimizer steps) that lie in a region with a main copy, shaped like each target.
        Views, not copies, while nothing wrote into the region: read them before the next
        step."""
        out: dict[int, torch.Tensor] = {}
        for holder in list(self.held.values()):
            main = holder.main
            exact = main.exact()
            for i, t in targets.items():
                at = offset_in(t, main.region)
                if at is not None:
                    out[i] = exact[at : at + t.numel()].view(t.shape)
        return out

    def load(
        self, targets: Sequence[torch.Tensor], values: Mapping[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Give the regions holding ``targets`` the exact ``values`` (by flat index; each of
        its target's number of elements). Returns the values of targets no region holds
        (not laid out: world size 1, a frozen param)."""
        left: dict[int, torch.Tensor] = {}
        for i, values_i in values.items():
            target = targets[i]
            for holder, region in self.regions:
                at = offset_in(target, region)
                if at is not None:
                    self._copy_of(holder, region).load(at, values_i.to(region.device))
                    break
            else:
                left[i] = values_i
        return left
