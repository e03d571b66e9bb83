"""What ``OSS.step`` checks when nothing is supposed to have changed since the layout was built.

:class:`ChangeDetector` caches the flat params and their ``requires_grad`` when a layout is
installed; :meth:`ChangeDetector.trainability_changed` compares them again. The re-allocation
check (every bucketed param still a view of its bucket) is the sync's own
(``is_intact()``, part of the contract of an installed sync).

The checks read one attribute per param at C speed (``map`` over a C getter: no Python frame
per param); at world size 1 nothing is checked (the plan of one rank does not depend on
trainability, and nothing is laid out).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

__all__ = ["ChangeDetector"]

#: Reads ``requires_grad`` at C speed when mapped over the params (no Python frame per param).
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class ChangeDetector:
    """The trainability a layout was built for, and the check against the params' now.

    Args:
        world_size: the group's size (nothing is checked at 1).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.params: list[torch.Tensor] = []
        self.trainable: list[bool] = []

    def reset(self, params: Sequence[torch.Tensor]) -> None:
        """Remember ``params`` (flat order) and their trainability (after a layout change)."""
        self.params = list(params)
        self.trainable = list(map(_REQUIRES_GRAD, self.params))

    def trainability_changed(self) -> bool:
        """Whether a param's ``requires_grad`` changed since :meth:`reset` (never at world
        size 1)."""
        if self.world_size == 1:
            return False
        return list(map(_REQUIRES_GRAD, self.params)) != self.trainable
