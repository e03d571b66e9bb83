"""Stepping the main copies themselves (Megatron-Core's layout, issue 36 item 4).

A region sent on a compressed wire has a main copy of its exact values
(:mod:`oss_plus.wire.main.region`). Rather than putting those values back into the params before
the local step and taking them out again after it (two passes over the region), the tensors
the inner optimizer steps are pointed at their main copies for the duration of that step
(:class:`Redirect`): the inner optimizer steps the exact values in place, its state stays
keyed by the same tensors (so state dicts, checkpoints and repartitions see nothing), and
the gradients stay where they are (``.data`` changes, ``.grad`` does not). After the step
every tensor points at its place in the bucket again, and the send rounds the main values
into the wire copy and widens them into the region: two passes per step where the fp32
wire makes none.

Pointing is one ``.data`` assignment per stepped tensor each way: the assignment itself,
not the loop around it, is the cost (measured on CPU, torch 2.13, a loaded machine: 0.44-0.87
us per tensor for both, 0.45 us with C-speed ``map(setattr, ...)``). Inner-optimizer params
kept on the main values for good would still need their ``.grad`` set at every step
(``zero_grad()`` sets grads to None by default: 0.28 us per tensor measured) and their
state re-keyed whenever the wire is switched, so this layout is kept for now.

A region is stepped this way only when every stepped tensor overlapping it lies inside it
(:func:`redirects`); otherwise (a view across regions) its exact values are put back into
it as before (:meth:`oss_plus.wire.main.region.MainCopy.restore`).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from types import TracebackType

import torch

from oss_plus.wire.main.copies import MainCopies
from oss_plus.wire.main.region import MainCopy, offset_in, overlaps

__all__ = ["Plans", "Redirect", "redirects"]

#: ``(tensor the inner optimizer steps, its main values, its place in the bucket)``
Pair = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_PTR = operator.methodcaller("data_ptr")
_GENERATIONS = itertools.count()


def redirects(main: MainCopy, stepped: Sequence[torch.Tensor]) -> list[Pair] | None:
    """The tensors of ``stepped`` whose memory lies in ``main``'s region, each with its
    main values and its place in the region; None when one of them overlaps the region
    without lying inside it (that region is restored instead)."""
    pairs: list[Pair] = []
    for tensor in stepped:
        if not overlaps(tensor, main.region):
            continue
        at = offset_in(tensor, main.region)
        if at is None:
            return None
        view = main.main[at : at + tensor.numel()].view(tensor.shape)
        pairs.append((tensor, view, tensor.data))
    return pairs


class Plans:
    """The :func:`redirects` of every main copy (kept on it), computed again when the
    stepped tensors are other tensors or moved (one C-speed read of each per step)."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._generation = next(_GENERATIONS)

    def follow(self, stepped: Sequence[torch.Tensor]) -> None:
        """Forget every plan when ``stepped`` are other tensors or moved."""
        key = (tuple(map(id, stepped)), tuple(map(_PTR, stepped)))
        if key != self._key:
            self._key, self._generation = key, next(_GENERATIONS)

    def restore(
        self,
        mains: MainCopies,
        compressed: Callable[[torch.dtype], bool],
        keys: set[int] | None,
        stepped: Callable[[], Sequence[torch.Tensor]] | None,
    ) -> Redirect:
        """:meth:`oss_plus.wire.main.copies.MainCopies.restore`; with ``stepped()`` (the tensors
        the inner optimizer steps) a region still compressed is not restored: the result
        points those in it at its main values (enter it around the local step)."""
        if not mains.held:
            return Redirect()
        tensors = None if stepped is None else stepped()
        plan = None
        if tensors is not None:
            self.follow(tensors)
            plan = functools.partial(self.of, stepped=tensors)
        return Redirect(mains.restore(compressed, keys, plan))

    def of(self, main: MainCopy, stepped: Sequence[torch.Tensor]) -> list[Pair] | None:
        """The redirects of ``main`` for ``stepped`` (once per layout and shard)."""
        if main.redirects is None or main.redirects[0] != self._generation:
            main.redirects = (self._generation, redirects(main, stepped))
        return main.redirects[1]


class Redirect:
    """Points tensors at their main values while the inner optimizer steps (a context
    manager; the tensors get their place in the bucket back on exit, also on an error).

    Args:
        pairs: what :func:`redirects` found.
    """

    def __init__(self, pairs: Sequence[Pair] = ()) -> None:
        self.pairs = list(pairs)

    def __enter__(self) -> Redirect:
        for tensor, main, _ in self.pairs:
            tensor.data = main
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for tensor, _, home in self.pairs:
            tensor.data = home
