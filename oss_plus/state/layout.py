"""The memory layout of state tensors: strides and views, kept without pickle. Pure: no I/O,
no collectives.

``torch.save`` writes each storage once and every tensor as (storage, offset, size, stride),
so a transposed view comes back transposed and two views of one buffer come back sharing it.
pytorch_optimizer's ``SOAP`` keeps its eigenbases as transposed views (stride ``(1, n)``);
a contiguous copy of one gives other matmul roundings. oss_plus moves and saves tensors as
their values, so a tensor whose layout is not the default travels as a *view node*
(``{"view": ...}`` in the skeleton of :mod:`oss_plus.state.nested`) over a plain 1-D tensor,
the *span*: the elements of its storage from the first to the last one it uses.

What is kept, for the tensors of one state value (what one call of
:func:`oss_plus.state.nested.flatten_value` encodes: the value of one key of one param's
state, e.g. a list of views):

* every tensor's size, dtype and strides, exactly;
* storage sharing: tensors of one dtype on one storage come back as views of one new
  storage, at the same distances from each other (one span covers them all);
* the storage offset, counted from the first element those tensors use (the span's start):
  a tensor whose storage starts where it does (a transposed or strided view of a tensor of
  its own) comes back with the offset ``torch.load`` gives it. The part of a storage that no
  state tensor of the value reaches is not carried (``torch.save`` writes it), so a view
  into a larger buffer comes back with its strides but offset 0 of a smaller storage.

Not kept: sharing across state keys or params (each value travels on its own, as its owner
steps it; a shared 0-dim tensor comes back as copies) and between tensors of different
dtypes (each gets its own span). A tensor with the default strides that shares nothing
travels as itself (a plain ``{"tensor": n}``), so contiguous state costs nothing new.

Example:
    >>> base = torch.arange(6.0).reshape(2, 3)
    >>> spans = plan_spans([base.t(), base[:, 0]])
    >>> node, span = view_node(base.t(), spans)
    >>> node, span.tolist()
    ({'size': [3, 2], 'stride': [1, 3], 'offset': 0}, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    >>> build_view(span, node["size"], node["stride"], node["offset"], "Q").stride()
    (1, 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "VIEW_TAG",
    "build_view",
    "default_stride",
    "extent",
    "is_default_layout",
    "own_storage",
    "plan_spans",
    "storage_key",
    "view_node",
]

#: Tag of a view node in a skeleton: ``{"view": {"of": {"tensor": n}, "size": [...],
#: "stride": [...], "offset": k}}``; tensor ``n`` is the span (1-D), ``offset`` counts
#: elements from its start.
VIEW_TAG = "view"

#: A storage, as :func:`plan_spans` groups tensors: (device, dtype, storage data pointer).
_StorageKey = tuple[str, torch.dtype, int]


def default_stride(size: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (what ``torch.empty(size)`` has).

    Example:
        >>> default_stride([2, 3, 4])
        (12, 4, 1)
    """
    stride, at = [], 1
    for s in reversed(size):
        stride.append(at)
        at *= max(int(s), 1)
    return tuple(reversed(stride))


def extent(size: Sequence[int], stride: Sequence[int]) -> int:
    """How many storage elements a tensor of ``size`` and ``stride`` spans (0 if empty).

    Example:
        >>> extent([3, 2], [1, 3]), extent([3], [2]), extent([0, 4], [4, 1])
        (6, 5, 0)
    """
    if math.prod(size) == 0:
        return 0
    return 1 + sum((int(n) - 1) * int(s) for n, s in zip(size, stride))


def is_default_layout(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has the strides of a fresh contiguous tensor of its size."""
    return tuple(tensor.stride()) == default_stride(tensor.shape)


def storage_key(tensor: torch.Tensor) -> _StorageKey:
    """What tells storages apart (tensors on one storage share it when shared)."""
    return (str(tensor.device), tensor.dtype, tensor.untyped_storage().data_ptr())


def plan_spans(tensors: Sequence[torch.Tensor]) -> dict[_StorageKey, tuple[int, int]]:
    """The span ``[lo, hi)`` (storage elements) of every storage that needs one.

    A storage needs a span when one of ``tensors`` on it has a layout other than the
    default, or when two of them share it. Empty tensors share nothing.
    """
    groups: dict[_StorageKey, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() > 0 and t.layout == torch.strided:
            groups.setdefault(storage_key(t), []).append(t)
    spans = {}
    for key, members in groups.items():
        shared = len({id(t) for t in members}) > 1
        if shared or not all(is_default_layout(t) for t in members):
            lo = min(int(t.storage_offset()) for t in members)
            hi = max(int(t.storage_offset()) + extent(t.shape, t.stride()) for t in members)
            spans[key] = (lo, hi)
    return spans


def view_node(
    tensor: torch.Tensor, spans: dict[_StorageKey, tuple[int, int]]
) -> tuple[dict[str, Any], torch.Tensor] | None:
    """The view node body (without ``of``) of ``tensor`` and its span (a live 1-D view of
    its storage), or None when ``tensor`` travels as itself.

    An empty tensor with other than the default strides gets a node over an empty span.
    """
    size, stride = [int(s) for s in tensor.shape], [int(s) for s in tensor.stride()]
    if tensor.numel() == 0:
        if is_default_layout(tensor):
            return None
        return {"size": size, "stride": stride, "offset": 0}, tensor.new_empty(0)
    span = spans.get(storage_key(tensor)) if tensor.layout == torch.strided else None
    if span is None:
        return None
    lo, hi = span
    whole = tensor.as_strided((hi - lo,), (1,), lo)
    return {"size": size, "stride": stride, "offset": tensor.storage_offset() - lo}, whole


def build_view(
    span: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int, where: str
) -> torch.Tensor:
    """The tensor of a view node: ``span`` (1-D, its storage starting at it) viewed with
    ``size``, ``stride`` and ``offset``.

    Raises:
        ValueError: the view reaches past the span, or ``span`` is not 1-D.
    """
    need = offset + extent(size, stride)
    if span.dim() != 1 or offset < 0 or any(s < 0 for s in stride) or need > span.numel():
        raise ValueError(
            f"{where}: a view of size {list(size)}, stride {list(stride)} at offset {offset} "
            f"needs {need} elements, but its storage holds {span.numel()} "
            f"(shape {tuple(span.shape)}); the state is damaged: restore or re-save it"
        )
    return span.as_strided(tuple(size), tuple(stride), span.storage_offset() + offset)


def own_storage(span: torch.Tensor) -> torch.Tensor:
    """``span`` if its storage starts at it and holds nothing else, else a copy that does
    (so views built on it have the offsets they were saved with)."""
    storage_elements = span.untyped_storage().nbytes() // max(span.element_size(), 1)
    if span.storage_offset() == 0 and span.is_contiguous() and storage_elements == span.numel():
        return span
    return span.clone(memory_format=torch.contiguous_format)
