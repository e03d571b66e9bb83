"""What ``OSS.step`` checks when nothing is supposed to have changed since the layout was built.

:class:`ChangeDetector` caches the flat params and their ``requires_grad`` when a layout is
installed; :meth:`ChangeDetector.trainability_changed` compares them again, and
:class:`Addresses` tells whether tensors still have the addresses they had (the
re-allocation check of :meth:`oss_plus.wire.sync.BucketSync.is_intact`).

Cost (issue 27: at most 0.1 us per param and step): no Python frame per param, and no more
than one C call per param and step:

* a param frozen in the plan that now requires a gradient would be stepped by its owner and
  sent by nobody: every frozen param is read at every step;
* a param re-allocated (``.data`` replaced, ``module.to()``) would no longer be updated by the
  sync: every bucketed param's address is read at every step
  (``list(map(Tensor.const_data_ptr))`` against the cached list; torch's C loop
  ``torch._C._tensors_data_ptrs_at_indices_equal`` where the build has it, CUDA builds,
  over lists built once per layout: copying them per check cost more than the loop saves.
  Measured at 2000 params: 66 ns per param for the ``map`` on torch 2.14.1, 70 ns for
  the C loop (89 ns with the copies); 69 and 37 ns on 2.6; all with the params in cache:
  right after a backward, 300-450 ns per param on the CPU proxy of ``docs/zero2.md``, the
  param objects' cache misses);
* a param trainable in the plan that was frozen is still sent by its owner and, without a
  gradient, not stepped (what the plain optimizer does): it only makes the plan uneven. So
  those are read :data:`WINDOWS` times more slowly, a slice of them per check, in the same
  order on every rank: a freeze is repartitioned within ``WINDOWS`` steps, an unfreeze and a
  re-allocation at the next step. A slice is a contiguous run of them in flat order
  (neighbours in memory): every ``WINDOWS``-th param, as before, cost 49-60 us per check
  for 2000 params right after a 2-rank step against 33-45 us for a run (thread CPU time,
  median of 200, three and four runs). For at most ``WINDOWS`` trainable params both are
  one param per check, in the same order.

At world size 1 nothing is checked (the plan of one rank does not depend on trainability,
and nothing is laid out).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

__all__ = ["WINDOWS", "Addresses", "ChangeDetector"]

#: The params trainable in the plan are read in this many slices, one per check.
WINDOWS = 16

#: Reads ``requires_grad`` at C speed when mapped over the params (no Python frame per param).
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
#: Reads a tensor's address at C speed when mapped over the params. ``const_data_ptr``
#: (torch >= 2.1) gives the same address as ``data_ptr`` with fewer checks and never
#: materializes a copy-on-write storage: 4-13% less (2000 params right after a 2-rank step,
#: thread CPU time, median of 200, eight runs: 220-512 against 238-579 us). Reading the
#: params sorted by object address instead of in bucket order changed nothing reliably
#: (-9% to +8% over the same runs).
_DATA_PTR = getattr(torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr)


#: torch's C loop comparing addresses (private; in CUDA builds only).
_ptrs_equal: Callable[..., bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None
)


class Addresses:
    """The data addresses ``tensors`` had when this was made, and the check that they kept
    them (exact: a tensor whose ``.data`` was replaced has another address, its old storage
    alive or not).

    Example:
        >>> t = torch.zeros(2)
        >>> kept = Addresses([t])
        >>> kept.intact(), Addresses([]).intact()
        (True, True)
        >>> t.data = torch.ones(2)
        >>> kept.intact()
        False
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.expected = list(map(_DATA_PTR, self.tensors))
        self._at = list(range(len(self.tensors)))  # the C loop's indices, built once

    def intact(self) -> bool:
        """Whether every tensor still starts at the address it had (one C call, or one
        ``map`` at C speed; no Python frame per tensor)."""
        if _ptrs_equal is not None:
            return bool(_ptrs_equal(self.tensors, self.expected, self._at))
        return list(map(_DATA_PTR, self.tensors)) == self.expected


class ChangeDetector:
    """The trainability a layout was built for, and the check against the params' now.

    Args:
        world_size: the group's size (nothing is checked at 1).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.params: list[torch.Tensor] = []
        self.trainable: list[bool] = []
        self._on: list[list[torch.Tensor]] = []
        self._off: list[torch.Tensor] = []
        self._checks = 0  # advanced at every check, the same on every rank

    def reset(self, params: Sequence[torch.Tensor]) -> None:
        """Remember ``params`` (flat order) and their trainability (after a layout change)."""
        self.params = list(params)
        self.trainable = list(map(_REQUIRES_GRAD, self.params))
        on = [p for p, t in zip(self.params, self.trainable) if t]
        size = -(-len(on) // WINDOWS)  # contiguous runs: neighbours in memory (see above)
        self._on = [on[w * size : (w + 1) * size] for w in range(WINDOWS)]
        self._off = [p for p, t in zip(self.params, self.trainable) if not t]

    def trainability_changed(self) -> bool:
        """Whether a frozen param now requires a gradient, or a param of this check's
        slice of the trainable ones no longer does (never at world size 1; see the module
        doc)."""
        if self.world_size == 1:
            return False
        window = self._on[self._checks % WINDOWS] if self._on else []
        self._checks += 1
        return any(map(_REQUIRES_GRAD, self._off)) or not all(map(_REQUIRES_GRAD, window))
