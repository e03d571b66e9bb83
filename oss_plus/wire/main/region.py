"""Main copies: the exact values of what a rank sends on a compressed wire (issue 27).

When a bucket travels in a dtype narrower than its own (an fp16/bf16 wire for fp32 params),
every rank, the owner included, holds the same rounded values after the sync: the owner
rounds its own params too. So that updates smaller than the wire's resolution still
accumulate (Megatron-Core's fp32 main params), the owner keeps a :class:`MainCopy` of its
region in the params' dtype:

* after its local step, before sending: ``main <- region`` (the exact values), ``wire <-
  region`` (rounded); once the transfer of ``wire`` started, ``region <- wire`` (the owner
  holds what every rank receives; the pass overlaps the transfer, which reads only
  ``wire``); then it records the version counter (``Tensor._version``) of every param whose
  memory lies in the region;
* before its next local step the inner optimizer steps ``main`` itself
  (:mod:`oss_plus.wire.main.step`; :meth:`MainCopy.absorb` first takes any write since the sync,
  and the next send rounds ``main``, not the region), or, for a region it cannot step that
  way, :meth:`MainCopy.restore` puts the exact values back. When no version moved
  (nothing wrote into those params since), that is nothing (one copy of the region for a
  restore); when one did (``model.load_state_dict``, ``p.mul_()`` under ``no_grad``, any in-place
  write through the param), element by element where the region still holds the value the
  sync gave it: an element changed in between keeps its new value, and its main value
  follows it. Writes through ``p.data`` bypass the version counter: call
  :meth:`oss_plus.wire.main.copies.MainCopies.written` after them (``docs/amp.md``).

The exact values travel with the optimizer's state as the per-param entry :data:`MAIN_KEY`
(:meth:`oss_plus.wire.main.copies.MainCopies.values` exports them,
:meth:`~oss_plus.wire.main.copies.MainCopies.load` takes them back on the new owner), so a
checkpoint, a consolidated state dict and a repartition keep them. Values brought that way
are restored where the param holds them rounded to a 16-bit wire (the values every replica
held when they were saved), so the model may be loaded before or after the optimizer.
The per-rank set of copies is :mod:`oss_plus.wire.main.copies`.

Nothing is kept for an uncompressed bucket: turning the wire off restores the exact values
at the next step, which then sends them exactly to every rank, and the copies are dropped.
Memory: the params' dtype for every element this rank sends compressed (``1/N`` of the
compressed params): 4 bytes per fp32 element, nothing else.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["MAIN_KEY", "MainCopy", "carry_main_values", "main_values"]

#: The per-param state entry holding a param's exact values (its main copy), shaped like the
#: param (like its piece under the flat rule). Reserved: the inner optimizer never sees it.
MAIN_KEY = "oss_plus.main"

#: Reads a tensor's version counter at C speed when mapped over tensors.
_VERSION = operator.attrgetter("_version")


class _Mode(enum.Enum):
    SENT = "sent"  # main holds the exact values of what the last sync rounded
    LOADED = "loaded"  # main holds exact values from a load or a repartition
    RESTORED = "restored"  # the region holds the exact values (nothing to put back)
    STEPPED = "stepped"  # main holds the exact values, the inner optimizer steps it


def offset_in(tensor: torch.Tensor, region: torch.Tensor) -> int | None:
    """The element offset of ``tensor``'s memory in ``region``, or None when it does not lie
    inside it (as one contiguous run of the same dtype)."""
    start = tensor.data_ptr() - region.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    inside = start >= 0 and end <= region.numel() * region.element_size()
    if not inside or tensor.dtype != region.dtype or not tensor.is_contiguous():
        return None
    return start // region.element_size()


def overlaps(tensor: torch.Tensor, region: torch.Tensor) -> bool:
    """Whether the memory of ``tensor`` and ``region`` overlap."""
    low, high = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    start = region.data_ptr()
    return low < start + region.numel() * region.element_size() and start < high


def held_rounded(region: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
    """Where ``region`` holds ``main`` as it is or rounded to a 16-bit wire (bf16 or fp16):
    the values every replica held when loaded main values were saved (the wire that
    rounded them is not recorded)."""
    same = region == main
    if region.is_floating_point() and region.element_size() > 2:
        for wire in (torch.bfloat16, torch.float16):
            same |= region == main.to(wire).to(region.dtype)
    return same


class MainCopy:
    """The exact values of one region this rank sends compressed.

    Args:
        region: the params' memory this rank updates and sends (a view of its bucket).
        writers: the params whose memory lies (partly) in ``region``: their version
            counters tell whether anything wrote into them since the last sync.
    """

    def __init__(self, region: torch.Tensor, writers: Sequence[torch.Tensor]) -> None:
        self.region = region
        self.writers = list(writers)
        self.main = torch.empty_like(region)
        #: the wire copy the last sync sent (its dtype is the wire's), or None
        self.sent: torch.Tensor | None = None
        self.mode = _Mode.RESTORED
        self._versions: list[int] = []
        self._compare = False  # written(): compare every element at the next restore
        #: ``(generation, pairs)`` of :class:`oss_plus.wire.main.step.Plans`, or None
        self.redirects: tuple[int, Any] | None = None

    @property
    def wire(self) -> torch.dtype | None:
        """The dtype the region last travelled as."""
        return None if self.sent is None else self.sent.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: the main values."""
        return self.main.nbytes

    @torch.no_grad()
    def send(self, sent: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """Keep the region's exact values and write them rounded into ``sent`` (the wire
        copy); :meth:`widen` then rounds the region the same way. After a step of the main
        copy itself (:meth:`absorb`) the main values are rounded (one pass; the status
        ``slot``, a view of the region, is taken first); else the region is kept, then
        rounded (two passes)."""
        self.sent = sent
        if self.mode is _Mode.STEPPED:
            at = None if slot is None else offset_in(slot, self.region)
            if slot is not None and at is not None:
                self.main[at : at + slot.numel()].copy_(slot.reshape(-1))
            sent.copy_(self.main)
        else:
            self.main.copy_(self.region)
            sent.copy_(self.region)
        self.mode, self._compare = _Mode.SENT, False

    @torch.no_grad()
    def widen(self) -> None:
        """After :meth:`send`: the region takes the values every rank receives (``sent``
        widened; called once the transfer of ``sent`` started, so that the pass overlaps
        it: the transfer only reads ``sent``); record the writers' versions."""
        assert self.sent is not None
        self.region.copy_(self.sent)
        self._versions = list(map(_VERSION, self.writers))

    def written(self) -> None:
        """Something wrote into the region without moving a version counter (``p.data``):
        compare every element at the next restore."""
        self._compare = True

    def _clean(self) -> bool:
        """Nothing wrote into the region since the sync (one version read per writer)."""
        return (
            self.mode is _Mode.SENT
            and not self._compare
            and list(map(_VERSION, self.writers)) == self._versions
        )

    def _kept(self) -> torch.Tensor:
        """Where the region still holds the main values rounded (element by element)."""
        if self.mode is _Mode.SENT:
            assert self.sent is not None
            return self.region == self.sent
        return held_rounded(self.region, self.main)

    @torch.no_grad()
    def exact(self) -> torch.Tensor:
        """The exact values of the region now (``main`` itself when nothing was written;
        not a copy: read it before the next step)."""
        if self.mode is _Mode.RESTORED:
            return self.region
        if self.mode is _Mode.STEPPED or self._clean():
            return self.main
        return torch.where(self._kept(), self.main, self.region)

    @torch.no_grad()
    def restore(self) -> None:
        """Put the exact values back where the region still holds them rounded."""
        if self.mode is _Mode.RESTORED:
            return
        if self.mode is _Mode.STEPPED or self._clean():
            self.region.copy_(self.main)
        else:
            torch.where(self._kept(), self.main, self.region, out=self.region)
        self.mode = _Mode.RESTORED

    @torch.no_grad()
    def absorb(self) -> None:
        """Before a local step that steps ``main`` itself (:mod:`oss_plus.wire.main.step`): make
        it the exact values of the region now. Nothing to do when nothing was written
        since the sync; else an element changed in between gives ``main`` its new value."""
        if self.mode is _Mode.RESTORED:
            self.main.copy_(self.region)
        elif not self._clean():
            torch.where(self._kept(), self.main, self.region, out=self.main)
        self.mode = _Mode.STEPPED

    @torch.no_grad()
    def load(self, at: int, values: torch.Tensor) -> None:
        """Take the exact values of the elements ``[at, at + values.numel())`` (a load or a
        repartition); they are put back at the next restore where the region holds them
        rounded."""
        if self.mode is not _Mode.LOADED:
            exact = self.exact()
            if exact is not self.main:
                self.main.copy_(exact)
            self.mode = _Mode.LOADED
        self.main[at : at + values.numel()].copy_(values.reshape(-1))


@torch.no_grad()
def apply_exact(target: torch.Tensor, values: torch.Tensor) -> None:
    """Write the exact ``values`` into ``target`` (no region holds it) where it holds them
    rounded to a 16-bit wire: there is no sync to keep them apart from the params."""
    exact = values.to(device=target.device, dtype=target.dtype).view(target.shape)
    target.copy_(torch.where(held_rounded(target, exact), exact, target))


@torch.no_grad()
def main_values(buckets: Sequence[Any]) -> dict[int, torch.Tensor]:
    """Before ``buckets`` are dropped (a new layout of the same params): by ``id`` of each
    param of a bucket holding a main copy, its exact values (a copy)."""
    carried: dict[int, torch.Tensor] = {}
    for bucket in buckets:
        main = bucket.main
        if main is None:
            continue
        exact = main.exact()
        for p in bucket.params:
            at = offset_in(p, main.region)
            if at is not None:
                carried[id(p)] = exact[at : at + p.numel()].clone()
    return carried


@torch.no_grad()
def carry_main_values(buckets: Sequence[Any], carried: dict[int, torch.Tensor]) -> None:
    """Give the new ``buckets`` main copies holding the ``carried`` exact values of their
    params (:func:`main_values`; those used leave ``carried``); their regions hold the values
    every rank holds."""
    for bucket in buckets:
        known = [(p, carried.pop(id(p))) for p in bucket.params if id(p) in carried]
        if not known:
            continue
        main = MainCopy(bucket.flat, bucket.params)
        for p, values in known:
            at = offset_in(p, main.region)
            if at is not None:
                main.load(at, values)
        bucket.main = main


def split_main(
    states: Mapping[int, Mapping[str, Any]],
) -> tuple[dict[int, dict[str, Any]], dict[int, torch.Tensor]]:
    """Split per-param states into the inner optimizer's states (without :data:`MAIN_KEY`;
    a state left empty is dropped) and the main values, by flat index (PURE).

    Example:
        >>> plain, mains = split_main({0: {"step": 1, MAIN_KEY: torch.ones(2)}, 1: {MAIN_KEY: 0}})
        >>> plain, sorted(mains)
        ({0: {'step': 1}}, [0, 1])
    """
    plain: dict[int, dict[str, Any]] = {}
    mains: dict[int, Any] = {}
    for i, state in states.items():
        rest = {k: v for k, v in state.items() if k != MAIN_KEY}
        if MAIN_KEY in state:
            mains[i] = state[MAIN_KEY]
        if rest:
            plain[i] = rest
    return plain, mains
