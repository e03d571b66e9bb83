"""PURE: the flat rule's gradient buffers and their buckets (ZeRO-2 with ``partition_rule="flat"``).

Under the flat rule (:func:`oss_plus.planning.partition.cut_flat`) the trainable params of one
(device, dtype) key sit back to back, each at an aligned offset, in one virtual buffer of
``world_size`` equal ranges; rank ``r`` owns the elements of range ``r``. The gradient
buffer has the same layout (as Megatron-Core's distributed optimizer lays its gradient
buffer out like its parameter buffer), so a rank's gradients are one slice: rank ``r``
keeps one persistent buffer over the used part of its range, whole params inside it get
``.grad`` as views of it, and a param cut by a range boundary hands each holder the slice
over its piece (``OSS.set_piece_grad``), a view of the same buffer.

Buckets are contiguous slices of the virtual buffer that never cross a range boundary, so
each is summed onto one rank with one collective, and a param cut by a boundary needs no
collective of its own: its pieces travel in the buckets of their ranges. Within a range the
slices are cut, from its end down (the order backward usually produces the gradients in),
at param boundaries into at most ``bucket_numel`` elements (a larger param alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oss_plus.planning.partition import flat_offsets

__all__ = ["FlatSlice", "cut_param", "cut_slices", "key_layout"]


@dataclass(frozen=True)
class FlatSlice:
    """A bucket of a flat key: elements ``[lo, hi)`` of the virtual buffer, in range ``owner``.

    Attributes:
        owner: the rank whose range holds the slice.
        lo: first element (in the key's virtual buffer).
        hi: end of the last member's elements (padding after it excluded).
        members: ``(param, start, end)``: the elements ``[start, end)`` of the flattened
            param the slice holds, in buffer order.
    """

    owner: int
    lo: int
    hi: int
    members: tuple[tuple[int, int, int], ...]


def key_layout(numels: Sequence[int], align: int, world_size: int) -> tuple[list[int], int]:
    """Offsets of a key's params (flat order) in its buffer, and the range size: exactly
    :func:`oss_plus.planning.partition.flat_offsets`, the rule the optimizer cut the params by.

    Example:
        >>> key_layout([10, 6], 1, 2)
        ([0, 10], 8)
    """
    return flat_offsets(numels, align, world_size)


def cut_param(offset: int, numel: int, region: int) -> list[tuple[int, int, int]]:
    """``(start, end, rank)`` of the pieces of a param at ``offset``, as the ranges cut it.

    Example:
        >>> cut_param(6, 5, 8)
        [(0, 2, 0), (2, 5, 1)]
    """
    pieces, at = [], offset
    while at < offset + numel:
        rank = at // region
        end = min(offset + numel, (rank + 1) * region)
        pieces.append((at - offset, end - offset, rank))
        at = end
    return pieces


def cut_slices(
    params: Sequence[int],
    numels: Sequence[int],
    offsets: Sequence[int],
    region: int,
    bucket_numel: int,
    close_after: bool = False,
) -> list[FlatSlice]:
    """Cut one key's buffer into buckets (see the module doc).

    Args:
        params: the params' indices, in the key's flat order.
        numels: their element counts.
        offsets: their offsets in the buffer (:func:`key_layout`).
        region: the size of each rank's range.
        bucket_numel: the largest slice; 0 or less: one slice per param and range.
        close_after: DDP's rule instead: a slice closes once it spans at least
            ``bucket_numel`` elements (the span that reached it included).

    Returns:
        The slices, last range first, each range from its end down.

    Example:
        >>> [(s.owner, s.lo, s.hi, s.members) for s in cut_slices([0, 1], [10, 6], [0, 10], 8, 100)]
        [(1, 8, 16, ((0, 8, 10), (1, 0, 6))), (0, 0, 8, ((0, 0, 8),))]
    """
    spans: dict[int, list[tuple[int, int, int, int]]] = {}  # range -> (lo, hi, param, start)
    for index, numel, offset in zip(params, numels, offsets):
        for start, end, rank in cut_param(offset, numel, region):
            spans.setdefault(rank, []).append((offset + start, offset + end, index, start))
    slices: list[FlatSlice] = []
    for rank in sorted(spans, reverse=True):
        current: list[tuple[int, int, int, int]] = []
        for span in reversed(spans[rank]):
            size = current[-1][1] - (current[0][0] if close_after else span[0]) if current else 0
            full = size >= bucket_numel if close_after else size > bucket_numel
            too_big = current and (bucket_numel <= 0 or full)
            if too_big:
                slices.append(_slice(rank, current))
                current = []
            current.insert(0, span)
        if current:
            slices.append(_slice(rank, current))
    return slices


def _slice(rank: int, spans: list[tuple[int, int, int, int]]) -> FlatSlice:
    members = tuple((index, start, start + hi - lo) for lo, hi, index, start in spans)
    return FlatSlice(rank, spans[0][0], spans[-1][1], members)
