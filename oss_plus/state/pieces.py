"""The optimizer state of a param cut into pieces (the flat rule), and back (PURE).

A piece's state holds, for every tensor shaped like the param, the same slice (1-D); every
other value (the ``step`` count) is the param's. For the elementwise optimizers the flat rule
accepts (:data:`oss_plus.step.pieces.ELEMENTWISE`) that is exactly the slice of the unsharded
optimizer's state. :func:`slice_state` cuts, :func:`stitch_state` joins: the local step
(``step.pieces``), consolidation and repartitioning (``state.consolidate``) use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from oss_plus.state.index import ParamState
from oss_plus.state.subclass import is_plain

__all__ = ["CANNOT_CUT", "slice_state", "stitch_state"]

#: Raised by :func:`slice_state` for block-quantized state (a tensor subclass).
CANNOT_CUT = (
    "state {key!r} is a {kind}, block-quantized optimizer state: its quantization blocks do "
    "not follow element ranges, so partition_rule='flat' cannot cut it into pieces; use "
    "partition_rule='fairscale' or 'torch', which keep every parameter whole"
)


def _shaped_like(value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == shape


def slice_state(state: ParamState, shape: torch.Size, start: int, end: int) -> ParamState:
    """Return the state of the piece ``[start, end)`` of a param of ``shape`` (PURE).

    Tensors shaped like the param become 1-D copies of the slice; every other value is
    kept (a 0-dim ``step``); the result shares no tensor with ``state`` that it sliced.

    Raises:
        TypeError: a tensor subclass shaped like the param (block-quantized state such as
            torchao's ``OptimState8bit``), which has no exact element range.

    Example:
        >>> state = {"step": 3, "m": torch.arange(6.0).view(2, 3)}
        >>> s = slice_state(state, torch.Size([2, 3]), 2, 5)
        >>> s["step"], s["m"].tolist()
        (3, [2.0, 3.0, 4.0])
    """
    for k, v in state.items():
        if _shaped_like(v, shape) and not is_plain(v):
            raise TypeError(CANNOT_CUT.format(key=k, kind=type(v).__name__))
    return {
        k: v.reshape(-1)[start:end].clone() if _shaped_like(v, shape) else v
        for k, v in state.items()
    }


def stitch_state(
    parts: Sequence[tuple[int, int, ParamState]], shape: torch.Size, index: int = -1
) -> ParamState:
    """Return the whole state of a param of ``shape`` from the states of its pieces (PURE).

    Args:
        parts: ``(start, end, state)`` of every piece, covering the param in order.
        shape: the param's shape.
        index: the flat index, for messages.

    Tensors shaped like each piece (1-D, ``end - start`` elements) are concatenated and given
    the param's shape; every other value is the first piece's.

    Raises:
        ValueError: pieces that do not cover the param, or whose states have different keys.

    Example:
        >>> a, b = {"step": 1, "m": torch.zeros(2)}, {"step": 1, "m": torch.ones(1)}
        >>> parts = [(0, 2, a), (2, 3, b)]
        >>> stitch_state(parts, torch.Size([3]))["m"].tolist()
        [0.0, 0.0, 1.0]
    """
    numel = 1
    for s in shape:
        numel *= s
    bounds = [(a, b) for a, b, _ in parts]
    covered = bool(bounds) and bounds[0][0] == 0 and bounds[-1][1] == numel
    covered = covered and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
    keys = [set(state) for _, _, state in parts]
    if not covered or any(k != keys[0] for k in keys):
        raise ValueError(
            f"state of param {index}: its pieces {bounds} (keys {keys}) do not make the whole "
            f"param of {numel} elements"
        )
    first = parts[0][2]
    whole: ParamState = {}
    for key, value in first.items():
        if all(_shaped_like(s[key], torch.Size([b - a])) for a, b, s in parts):
            whole[key] = torch.cat([s[key] for _, _, s in parts]).view(shape)
        else:
            whole[key] = value
    return whole
