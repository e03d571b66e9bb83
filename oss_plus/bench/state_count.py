"""Count the bytes an optimizer's state really holds, tensor subclasses included.

``numel() * element_size()`` of torchao's low-bit state (``OptimState8bit`` ...) reports its
appearance dtype (fp32), four times what it holds. Here every tensor is taken apart through
``__tensor_flatten__`` (recursively, so a ``DTensor`` of a subclass works too) down to plain
tensors, and the bytes are those of their distinct storages: a lookup table shared by every
parameter (bitsandbytes' ``qmap``) counts once, a view counts its whole storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StateCount", "count_state", "plain_tensors", "storage_bytes"]

#: Element sizes of low-bit codes: a state holding such a tensor is quantized.
_CODE_SIZES = (1,)


def plain_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Yield the plain tensors inside ``value`` (tensors, subclasses, dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from plain_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from plain_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from plain_tensors(item)


def _key(tensor: torch.Tensor) -> tuple[str, int, int]:
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr(), storage.nbytes())


def storage_bytes(value: Any, seen: set[tuple[str, int, int]] | None = None) -> int:
    """Bytes of the distinct storages under ``value`` not already in ``seen`` (updated).

    Example:
        >>> t = torch.zeros(10)
        >>> storage_bytes({"a": t, "b": t[2:], "c": torch.zeros(3, dtype=torch.uint8)})
        43
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in plain_tensors(value):
        key = _key(tensor)
        if key not in seen:
            seen.add(key)
            total += key[2]
    return total


@dataclass(frozen=True)
class StateCount:
    """An optimizer's state as counted by :func:`count_state`.

    Attributes:
        total: bytes of every distinct storage in ``optimizer.state``.
        tensors: params with state.
        full: params whose state holds no low-bit codes (1-byte elements): fp32 state, all
            of them under a full-precision optimizer, the small ones under a low-bit one.
        full_numel: the elements of those params.
        full_bytes: the bytes first counted at those params.
    """

    total: int
    tensors: int
    full: int
    full_numel: int
    full_bytes: int


def count_state(optimizer: torch.optim.Optimizer) -> StateCount:
    """Count ``optimizer.state`` (see the module doc)."""
    seen: set[tuple[str, int, int]] = set()
    total = tensors = full = full_numel = full_bytes = 0
    for param, state in optimizer.state.items():
        size = storage_bytes(state, seen)
        total += size
        tensors += 1
        if not any(t.element_size() in _CODE_SIZES for t in plain_tensors(state)):
            full, full_numel, full_bytes = full + 1, full_numel + param.numel(), full_bytes + size
    return StateCount(total, tensors, full, full_numel, full_bytes)
