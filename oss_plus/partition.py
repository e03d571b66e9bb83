"""Which rank owns which parameter: pure functions on plain data.

This module never imports ``torch.distributed`` and never looks at tensors: callers describe
each parameter by a :class:`ParamSpec` (its element count and whether it is trainable) and
get back, for every parameter group, the owning rank of each parameter.

Two rules are offered, one per anchor:

* :attr:`Rule.FAIRSCALE` (the default of :class:`oss_plus.OSS`): parameters are taken in the
  order they were given; each goes to the first rank with the smallest running total; a frozen
  parameter weighs 1 (it holds no optimizer state); totals carry over from one group to the next.
* :attr:`Rule.TORCH` (``torch.distributed.optim.ZeroRedundancyOptimizer``): within each group
  parameters are sorted by element count, largest first (stable); frozen parameters weigh their
  full size; otherwise the same greedy choice.

Both rules can *extend* an existing assignment (``fixed``): parameters that already have an
owner keep it and only count towards the totals. This is how a new parameter group is placed
without moving parameters that already carry optimizer state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ParamSpec", "Rule", "assign_owners", "rank_loads"]

#: Position of a parameter: (group index, index within the group).
ParamPos = tuple[int, int]


@dataclass(frozen=True)
class ParamSpec:
    """What the partition needs to know about one parameter.

    Attributes:
        numel: number of elements.
        trainable: whether the parameter currently requires a gradient.
    """

    numel: int
    trainable: bool = True

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"ParamSpec.numel must be >= 0, got {self.numel}")


class Rule(str, enum.Enum):
    """A partition rule: see the module docstring."""

    FAIRSCALE = "fairscale"
    TORCH = "torch"

    def weight(self, spec: ParamSpec) -> int:
        """Return how much ``spec`` counts towards its owner's total under this rule."""
        if spec.trainable or self is Rule.TORCH:
            return spec.numel
        return 1

    def order(self, group: Sequence[ParamSpec]) -> list[int]:
        """Return the indices of ``group`` in the order this rule visits them."""
        indices = list(range(len(group)))
        if self is Rule.TORCH:
            indices.sort(key=lambda i: group[i].numel, reverse=True)  # stable
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


def rank_loads(
    groups: Sequence[Sequence[ParamSpec]], owners: Sequence[Sequence[int]], world_size: int
) -> list[int]:
    """Return the number of trainable elements each rank owns (the optimizer-state balance).

    Example:
        >>> rank_loads([[ParamSpec(10), ParamSpec(3, trainable=False)]], [[0, 1]], 2)
        [10, 0]
    """
    loads = [0] * world_size
    for group, group_owners in zip(groups, owners):
        for spec, rank in zip(group, group_owners):
            if spec.trainable:
                loads[rank] += spec.numel
    return loads
