"""Which rank owns which parameter: pure functions on plain data.

This module never imports ``torch.distributed`` and never looks at tensors: callers describe
each parameter by a :class:`ParamSpec` (its element count and whether it is trainable) and
get back, for every parameter group, the owning rank of each parameter.

The rules:

* :attr:`Rule.FAIRSCALE` (the default of :class:`oss_plus.OSS`): parameters are taken in the
  order they were given; each goes to the first rank with the smallest running total; a frozen
  parameter weighs 1 (it holds no optimizer state); totals carry over from one group to the next.
* :attr:`Rule.TORCH` (``torch.distributed.optim.ZeroRedundancyOptimizer``): within each group
  parameters are sorted by element count, largest first (stable); frozen parameters weigh their
  full size; otherwise the same greedy choice.
* :attr:`Rule.FLAT` (DeepSpeed ZeRO's and Megatron-Core's way, :func:`cut_flat`): per bucket
  key (device and dtype), the trainable parameters are laid back to back (each at an aligned
  offset) in one flat buffer that is cut into ``world_size`` equal, aligned ranges; rank ``r``
  owns the elements of range ``r``, so a parameter may be split into :class:`Piece` s owned by
  several ranks. Frozen parameters stay out of the buffer and are kept whole, round robin.
* :attr:`Rule.MUON` (torchtitan's placement of Muon's owners): the torch rule on the compute
  of a Muon step instead of the element count. Within each group, trainable 2-D parameters
  weigh the FLOPs of their Newton-Schulz iterations
  (:func:`~oss_plus.planning.ns_cost.ns_flops`), other trainable ones their element count,
  frozen ones 1; they are visited heaviest first (stable) and each goes to the first rank
  with the smallest running total: the longest-processing-time greedy. It needs the params'
  shapes (:attr:`ParamSpec.shape`); a spec without one weighs its element count.

The whole-tensor rules can *extend* an existing assignment (``fixed``): parameters that
already have an owner keep it and only count towards the totals. This is how a new parameter
group is placed without moving parameters that already carry optimizer state.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from oss_plus.planning.ns_cost import ns_flops

__all__ = [
    "ParamSpec",
    "Piece",
    "Rule",
    "assign_owners",
    "cut_flat",
    "flat_offsets",
    "piece_loads",
]

#: Position of a parameter: (group index, index within the group).
ParamPos = tuple[int, int]


@dataclass(frozen=True)
class ParamSpec:
    """What the partition needs to know about one parameter.

    Attributes:
        numel: number of elements.
        trainable: whether the parameter currently requires a gradient.
        key: the flat buffer it belongs to under :attr:`Rule.FLAT` (``OSS`` uses
            ``"<device>/<dtype>"``); parameters of one key share a buffer.
        align: under :attr:`Rule.FLAT`, the element alignment of its offset in the buffer
            and of the range boundaries (``OSS``: the allocator's, 64 bytes on CPU); the same
            for every parameter of a key.
        shape: the parameter's shape, or None when unknown; only :attr:`Rule.MUON` reads it.
    """

    numel: int
    trainable: bool = True
    key: str = ""
    align: int = 1
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"ParamSpec.numel must be >= 0, got {self.numel}")
        if self.align < 1:
            raise ValueError(f"ParamSpec.align must be >= 1, got {self.align}")
        if self.shape is not None:
            shape = tuple(self.shape)
            if any(d < 0 for d in shape) or math.prod(shape) != self.numel:
                raise ValueError(
                    f"ParamSpec.shape {shape} does not hold numel={self.numel} elements: "
                    "give the parameter's own shape, or none"
                )
            object.__setattr__(self, "shape", shape)


class Rule(str, enum.Enum):
    """A partition rule: see the module docstring."""

    FAIRSCALE = "fairscale"
    TORCH = "torch"
    FLAT = "flat"
    MUON = "muon"

    def weight(self, spec: ParamSpec) -> int:
        """Return how much ``spec`` counts towards its owner's total under this rule.

        Example:
            >>> Rule.MUON.weight(ParamSpec(6, shape=(2, 3))), Rule.TORCH.weight(ParamSpec(6))
            (320, 6)
        """
        if self is Rule.MUON and spec.trainable and spec.shape is not None:
            return ns_flops(spec.shape) if len(spec.shape) == 2 else spec.numel
        if spec.trainable or self is Rule.TORCH:
            return spec.numel
        return 1

    def order(self, group: Sequence[ParamSpec]) -> list[int]:
        """Return the indices of ``group`` in the order this rule visits them."""
        indices = list(range(len(group)))
        if self is Rule.TORCH:
            indices.sort(key=lambda i: group[i].numel, reverse=True)  # stable
        elif self is Rule.MUON:
            weights = [self.weight(spec) for spec in group]
            indices.sort(key=lambda i: weights[i], reverse=True)  # stable
        return indices


def _argmin(values: Sequence[int]) -> int:
    """Return the first index of the smallest value."""
    best = 0
    for i in range(1, len(values)):
        if values[i] < values[best]:
            best = i
    return best


def assign_owners(
    groups: Sequence[Sequence[ParamSpec]],
    world_size: int,
    rule: Rule | str = Rule.FAIRSCALE,
    fixed: Mapping[ParamPos, int] | None = None,
) -> list[list[int]]:
    """Assign every parameter to a rank.

    Args:
        groups: one sequence of :class:`ParamSpec` per parameter group.
        world_size: number of ranks (>= 1).
        rule: :class:`Rule` or its string value.
        fixed: owners that must be kept, keyed by ``(group, index)``; they count towards the
            totals before any free parameter is placed.

    Returns:
        ``owners[g][i]``: the rank that owns parameter ``i`` of group ``g``.

    Raises:
        ValueError: ``world_size`` < 1 or a fixed owner outside ``[0, world_size)``.

    Example:
        >>> assign_owners([[ParamSpec(10), ParamSpec(3), ParamSpec(4)]], 2)
        [[0, 1, 1]]
        >>> assign_owners([[ParamSpec(3), ParamSpec(10), ParamSpec(4)]], 2, "torch")
        [[1, 0, 1]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rule = Rule(rule)
    if rule is Rule.FLAT:
        raise ValueError("the flat rule splits params: use cut_flat, not assign_owners")
    fixed = dict(fixed or {})
    totals = [0] * world_size
    owners: list[list[int]] = [[-1] * len(group) for group in groups]
    for (g, i), rank in fixed.items():
        if not 0 <= rank < world_size:
            raise ValueError(
                f"fixed owner of param ({g}, {i}) is {rank}, outside [0, {world_size})"
            )
        owners[g][i] = rank
        totals[rank] += rule.weight(groups[g][i])
    for g, group in enumerate(groups):
        for i in rule.order(group):
            if owners[g][i] >= 0:
                continue
            rank = _argmin(totals)
            owners[g][i] = rank
            totals[rank] += rule.weight(group[i])
    return owners


@dataclass(frozen=True)
class Piece:
    """The elements ``[start, end)`` of the flattened parameter ``index``, owned by ``owner``.

    ``index`` is the flat index (position in the concatenated groups). A whole parameter is
    one piece ``[0, numel)``.
    """

    index: int
    start: int
    end: int
    owner: int

    @property
    def numel(self) -> int:
        """The number of elements of the piece."""
        return self.end - self.start


def padded(numel: int, align: int) -> int:
    """Round ``numel`` up to a multiple of ``align``.

    Example:
        >>> padded(10, 16), padded(32, 16)
        (16, 32)
    """
    return -(-numel // align) * align


def flat_offsets(numels: Sequence[int], align: int, world_size: int) -> tuple[list[int], int]:
    """Lay ``numels`` back to back, each at a multiple of ``align``; return their offsets and
    the size of each of the ``world_size`` equal ranges (a multiple of ``align``).

    The buffer then holds ``world_size * range`` elements (padding at the end).

    Example:
        >>> flat_offsets([10, 3, 4], 4, 2)
        ([0, 12, 16], 12)
    """
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end += padded(n, align)
    used = offsets[-1] + numels[-1] if numels else 0
    region = padded(-(-used // world_size), align) if used else 0
    return offsets, region


def cut_flat(groups: Sequence[Sequence[ParamSpec]], world_size: int) -> list[Piece]:
    """Cut the parameters into pieces by :attr:`Rule.FLAT` (see the module docstring).

    Per key, the trainable parameters (in flat order over every group) sit at the offsets of
    :func:`flat_offsets`; range ``r`` is ``[r * region, (r + 1) * region)`` and every
    parameter is cut where it crosses a range boundary, so each rank holds at most one piece
    of a parameter and a whole buffer is ``world_size`` equal ranges. A frozen (or empty)
    parameter is one whole piece: frozen ones go round robin, an empty one to the rank whose
    range holds its offset.

    Returns:
        Every piece, sorted by ``(index, start)``; the pieces of a parameter cover it.

    Raises:
        ValueError: ``world_size`` < 1, or parameters of one key with different ``align``.

    Example:
        >>> pieces = cut_flat([[ParamSpec(10), ParamSpec(6)]], 2)
        >>> [(p.index, p.start, p.end, p.owner) for p in pieces]
        [(0, 0, 8, 0), (0, 8, 10, 1), (1, 0, 6, 1)]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    specs = [s for group in groups for s in group]
    by_key: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.trainable:
            by_key.setdefault(spec.key, []).append(i)
    pieces: list[Piece] = []
    for key, members in by_key.items():
        aligns = {specs[i].align for i in members}
        if len(aligns) != 1:
            raise ValueError(f"params of flat key {key!r} have different alignments {aligns}")
        offsets, region = flat_offsets([specs[i].numel for i in members], aligns.pop(), world_size)
        for i, offset in zip(members, offsets):
            n = specs[i].numel
            if n == 0:
                pieces.append(Piece(i, 0, 0, min(offset // max(region, 1), world_size - 1)))
                continue
            for rank in range(offset // region, (offset + n - 1) // region + 1):
                start = max(offset, rank * region) - offset
                end = min(offset + n, (rank + 1) * region) - offset
                pieces.append(Piece(i, start, end, rank))
    frozen = [i for i, spec in enumerate(specs) if not spec.trainable]
    pieces += [Piece(i, 0, specs[i].numel, k % world_size) for k, i in enumerate(frozen)]
    return sorted(pieces, key=lambda p: (p.index, p.start))


def piece_loads(pieces: Sequence[Piece], trainable: Sequence[bool], world_size: int) -> list[int]:
    """Return the number of trainable elements each rank owns, from ``pieces``.

    Example:
        >>> piece_loads([Piece(0, 0, 8, 0), Piece(0, 8, 10, 1)], [True], 2)
        [8, 2]
    """
    loads = [0] * world_size
    for piece in pieces:
        if trainable[piece.index]:
            loads[piece.owner] += piece.numel
    return loads


def group_offsets(group_sizes: Sequence[int]) -> list[int]:
    """Return the flat index of the first parameter of every group.

    Example:
        >>> group_offsets([2, 0, 3])
        [0, 2, 2]
    """
    offsets, total = [], 0
    for size in group_sizes:
        offsets.append(total)
        total += size
    return offsets


def local_view(
    owners: Sequence[Sequence[int]], rank: int, orders: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Return, per group, the flat indices that ``rank`` owns, in visiting order.

    Args:
        owners: ``owners[g][i]`` as returned by :func:`oss_plus.planning.partition.assign_owners`.
        rank: the rank whose view is wanted.
        orders: per group, the order in which the local optimizer holds the params
            (:meth:`oss_plus.planning.partition.Rule.order`).

    Example:
        >>> local_view([[0, 1, 0], [1]], 0, [[0, 1, 2], [0]])
        [[0, 2], []]
    """
    offsets = group_offsets([len(g) for g in owners])
    return [
        [offsets[g] + i for i in order if owners[g][i] == rank] for g, order in enumerate(orders)
    ]
