"""Main copies: the exact values of what a rank sends on a compressed wire (issue 27).

When a bucket travels in a dtype narrower than its own (an fp16/bf16 wire for fp32 params),
every rank, the owner included, holds the same rounded values after the sync: the owner
rounds its own params too. So that updates smaller than the wire's resolution still
accumulate (Megatron-Core's fp32 main params), the owner keeps a :class:`MainCopy` of its
region in the params' dtype:

* after its local step, before sending: ``main <- region`` (the exact values), ``wire <-
  region`` (rounded), ``region <- wire`` (the owner holds what every rank receives);
* before its next local step: :meth:`MainCopy.restore` puts the exact values back, element
  by element where the param still holds the value the sync gave it (``region == wire``);
  an element changed in between (``model.load_state_dict``, an in-place edit) keeps its new
  value, and its main value follows it.

Nothing is kept for an uncompressed bucket: turning the wire off restores the exact values
at the next step, which then sends them exactly to every rank, and the copies are dropped.
Memory: the params' dtype for every element this rank sends compressed (``1/N`` of the
compressed params), plus one byte per element for the comparison (preallocated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MainCopy", "carry_main_values", "main_values"]


class MainCopy:
    """The exact values of one region this rank sends compressed.

    Args:
        region: the params' memory this rank updates and sends (a view of its bucket).
        sent: the wire copy that travels for it (its dtype is the wire's).
    """

    def __init__(self, region: torch.Tensor, sent: torch.Tensor) -> None:
        self.region, self.sent = region, sent
        self.main = torch.empty_like(region)
        self.mask = torch.empty_like(region, dtype=torch.bool)

    @property
    def wire(self) -> torch.dtype:
        """The dtype the region travels as."""
        return self.sent.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: the main values and the comparison's mask."""
        return self.main.nbytes + self.mask.nbytes

    @torch.no_grad()
    def send(self) -> None:
        """Keep the region's exact values, write them rounded into the wire copy and round
        the region the same way."""
        self.main.copy_(self.region)
        self.sent.copy_(self.region)
        self.region.copy_(self.sent)

    @torch.no_grad()
    def restore(self) -> None:
        """Put the exact values back where the region still holds what was sent."""
        torch.eq(self.region, self.sent, out=self.mask)
        torch.where(self.mask, self.main, self.region, out=self.region)


def _offset(param: torch.Tensor, region: torch.Tensor) -> int | None:
    """The element offset of ``param``'s memory in ``region``, or None outside it."""
    start = param.data_ptr() - region.data_ptr()
    inside = 0 <= start < region.numel() * region.element_size()
    return start // region.element_size() if inside else None


@torch.no_grad()
def main_values(buckets: Sequence[Any]) -> dict[int, tuple[torch.Tensor, torch.dtype]]:
    """Before ``buckets`` are dropped (a new layout of the same params): by ``id`` of each
    param of a bucket holding a main copy, its exact values (out of place) and the wire."""
    carried: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
    for bucket in buckets:
        main = bucket.main
        if main is None:
            continue
        exact = torch.where(main.region == main.sent, main.main, main.region)
        for p in bucket.params:
            at = _offset(p, main.region)
            if at is not None:
                carried[id(p)] = (exact[at : at + p.numel()].clone(), main.wire)
    return carried


@torch.no_grad()
def carry_main_values(
    buckets: Sequence[Any], carried: dict[int, tuple[torch.Tensor, torch.dtype]]
) -> None:
    """Give the new ``buckets`` main copies holding the ``carried`` exact values of their
    params (:func:`main_values`; those used leave ``carried``); their regions hold the values
    every rank holds."""
    for bucket in buckets:
        known = [(p, carried.pop(id(p))) for p in bucket.params if id(p) in carried]
        if not known:
            continue
        main = MainCopy(bucket.flat, bucket.wire_buffer(known[0][1][1]))
        main.main.copy_(main.region)
        main.sent.copy_(main.region)  # what the region holds was sent: restore() applies
        for p, (values, _) in known:
            at = _offset(p, main.region)
            if at is not None:
                main.main[at : at + p.numel()] = values
        bucket.main = main
