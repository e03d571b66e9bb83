"""The per-param gradient hooks of :class:`~oss_plus.data_parallel.reducer.GradReducer`.

One post-accumulate-grad hook per trainable param is the only per-param Python work of an
iteration. It does what that param needs and nothing else:

* an owned param whose ``.grad`` is a view of its persistent bucket: nothing when backward
  accumulated into the view; else one copy into it, and ``.grad`` becomes the view;
* any other whole param: one copy into its transient bucket, then ``.grad`` is dropped
  unless this rank receives the sum into it (ZeRO-2);
* a param of a flat key cut by a range boundary: one copy of each piece into the bucket of
  its range, then ``.grad`` is dropped on every rank (each holder gets its piece from its
  range buffer).

Then the hook counts its bucket(s) down and launches what became full. A gradient that
requires grad (``backward(create_graph=True)``, or a ``.grad`` given one by the user) is
reduced without its graph and noted: the reducer refuses it at the end of that backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from oss_plus.data_parallel.buckets import Buckets
from oss_plus.data_parallel.plan import ReducePlan

__all__ = ["GradReducer", "make_hook"]


class GradReducer(Protocol):
    """What the hooks use of :class:`oss_plus.data_parallel.reducer.GradReducer` (typed
    here, so that this module imports nothing above it)."""

    RUNNING: Any
    buckets: Buckets
    plan: ReducePlan
    fired: bytearray
    left: list[int]
    graph_grad: bool
    state: Any

    def begin(self) -> bool:
        """Start a reduction (see the reducer)."""


Hook = Callable[[torch.Tensor], None]


def make_hook(reducer: GradReducer, index: int, places: Sequence[tuple[int, int]]) -> Hook:
    """The hook of param ``index``, which sits in the buckets ``places`` ((bucket, slot))."""
    if len(places) > 1:
        return _pieces_hook(reducer, index, places)
    buckets = reducer.buckets
    b, slot = places[0]
    views = buckets.views[b]
    if views is not None:
        return _view_hook(reducer, index, b, views[slot])
    keep = buckets.owned[b] and not buckets.flat[b]  # receives its sum into .grad
    return _staging_hook(reducer, index, b, slot, keep)


def _view_hook(reducer: GradReducer, index: int, b: int, view: torch.Tensor) -> Hook:
    buckets, fired, running = reducer.buckets, reducer.fired, reducer.RUNNING

    def hook(param: torch.Tensor) -> None:  # owned: .grad is (or becomes) a bucket view
        if reducer.state is not running and not reducer.begin():
            return
        if fired[index]:
            return  # a second gradient in the same backward (reentrant): already in
        fired[index] = 1
        grad: torch.Tensor = param.grad  # type: ignore[assignment]  # set: it fired
        if grad is not view:
            if grad.requires_grad:  # double backward: refused at the end of backward
                reducer.graph_grad, grad = True, grad.detach()
            view.copy_(grad)
            param.grad = view
        left = reducer.left
        left[b] -= 1
        if not left[b]:
            buckets.bucket_full(b)

    return hook


def _staging_hook(reducer: GradReducer, index: int, b: int, slot: int, keep: bool) -> Hook:
    buckets, fired, running = reducer.buckets, reducer.fired, reducer.RUNNING

    def hook(param: torch.Tensor) -> None:  # copied into a transient bucket
        if reducer.state is not running and not reducer.begin():
            return
        if fired[index]:
            return
        fired[index] = 1
        grad: torch.Tensor = param.grad  # type: ignore[assignment]
        if grad.requires_grad:  # double backward: refused at the end of backward
            reducer.graph_grad, grad = True, grad.detach()
        (buckets.open[b] or buckets.staged(b))[slot].copy_(grad)
        if not keep:
            param.grad = None  # copied: free it now (ZeRO-2)
        left = reducer.left
        left[b] -= 1
        if not left[b]:
            buckets.bucket_full(b)

    return hook


def _pieces_hook(reducer: GradReducer, index: int, places: Sequence[tuple[int, int]]) -> Hook:
    buckets, fired, running = reducer.buckets, reducer.fired, reducer.RUNNING
    spans = [reducer.plan.buckets[b].spans[slot] for b, slot in places]

    def hook(param: torch.Tensor) -> None:  # cut by a range boundary: a copy per piece
        if reducer.state is not running and not reducer.begin():
            return
        if fired[index]:
            return
        fired[index] = 1
        copy_pieces(reducer, param, places, spans)
        left = reducer.left
        for b, _ in places:
            left[b] -= 1
            if not left[b]:
                buckets.bucket_full(b)

    return hook


@torch.no_grad()
def copy_pieces(
    reducer: GradReducer,
    param: torch.Tensor,
    places: Sequence[tuple[int, int]],
    spans: Sequence[tuple[int, int]],
) -> None:
    """Copy each piece of ``param``'s gradient into its bucket; drop the gradient."""
    buckets = reducer.buckets
    grad: torch.Tensor = param.grad  # type: ignore[assignment]
    if grad.requires_grad:
        reducer.graph_grad, grad = True, grad.detach()
    grad = grad.reshape(-1)
    for (b, slot), (start, end) in zip(places, spans):
        (buckets.views[b] or buckets.open[b] or buckets.staged(b))[slot].copy_(grad[start:end])
    param.grad = None
