"""Python numbers read from params' values, carrying which params they were read from.

A number that a step reads on the host (``.item()``, ``float()``) leaves the tensors a trace
follows; :class:`TracedFloat` and :class:`TracedInt` keep its *origins* (the params it was
computed from) through Python's arithmetic, into the ops and param-group values it reaches
(:class:`oss_plus.step.probe.trace.Tracer` reads them there). A comparison or ``bool()`` of
one read from two params is reported to the tracer as a host read. ``math`` functions and
other C code give back plain numbers: what they compute is left to the value witness.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

__all__ = [
    "Origin",
    "Origins",
    "TracedFloat",
    "TracedInt",
    "origins_of_value",
    "params_in",
    "taint_of",
    "wrap_nested",
]

Origin = int | str
Origins = frozenset[Origin]
EMPTY: Origins = frozenset()


def params_in(origins: Iterable[Origin]) -> list[int]:
    """The param indices of ``origins``, sorted."""
    return sorted(o for o in origins if isinstance(o, int))


class _Traced:
    """A Python number read from params' values, carrying their origins."""

    origins: Origins
    tracer: Any


def _wrap(value: Any, origins: Origins, tracer: Any) -> Any:
    if not origins:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    out: Any = TracedInt(value) if isinstance(value, int) else TracedFloat(value)
    out.origins, out.tracer = origins, tracer
    return out


def origins_of_value(value: Any) -> Origins:
    """The origins a Python number carries (none for a plain number)."""
    return getattr(value, "origins", EMPTY) if isinstance(value, _Traced) else EMPTY


def _plain(value: Any) -> Any:
    if isinstance(value, TracedInt):
        return int(value)
    return float(cast(float, value)) if isinstance(value, _Traced) else value


def _arith(kind: type, name: str) -> Any:
    base = getattr(kind, name)

    def op(self: Any, *others: Any) -> Any:
        if any(isinstance(o, torch.Tensor) for o in others):
            return NotImplemented  # the tensor's reflected op runs, traced with this number
        result = base(_plain(self), *map(_plain, others))
        if result is NotImplemented:
            return result
        merged = origins_of_value(self).union(*map(origins_of_value, others))
        return _wrap(result, merged, self.tracer)

    return op


def _compare(kind: type, name: str) -> Any:
    base = getattr(kind, name)

    def op(self: Any, other: Any) -> Any:
        if isinstance(other, torch.Tensor):
            return NotImplemented
        merged = origins_of_value(self) | origins_of_value(other)
        if self.tracer is not None:
            self.tracer.host_read(merged, f"a comparison ({name})")
        return base(_plain(self), _plain(other))

    return op


_ARITH = ["__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
          "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__", "__mod__", "__rmod__",
          "__floordiv__", "__rfloordiv__", "__pos__"]  # fmt: skip
_COMPARE = ["__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"]


class TracedFloat(_Traced, float):
    """A float read from the values of the params in :attr:`origins`."""

    __hash__ = float.__hash__

    def __bool__(self) -> bool:
        if self.tracer is not None:
            self.tracer.host_read(self.origins, "bool()")
        return float(self) != 0.0


class TracedInt(_Traced, int):
    """An int read from the values of the params in :attr:`origins`."""

    __hash__ = int.__hash__

    def __bool__(self) -> bool:
        if self.tracer is not None:
            self.tracer.host_read(self.origins, "bool()")
        return int(self) != 0

    def __index__(self) -> int:
        return int(self)


for _cls, _kind in ((TracedFloat, float), (TracedInt, int)):
    for _name in _ARITH:
        setattr(_cls, _name, _arith(_kind, _name))
    for _name in _COMPARE:
        setattr(_cls, _name, _compare(_kind, _name))


def wrap_nested(value: Any, origins: Origins, tracer: Any) -> Any:
    if isinstance(value, list):
        return [wrap_nested(v, origins, tracer) for v in value]
    return _wrap(value, origins, tracer)


def taint_of(values: Iterable[Any]) -> Origins:
    found: set[Origin] = set()
    for v in values:
        if isinstance(v, _Traced):
            found |= v.origins
        elif isinstance(v, (list, tuple)):
            found |= taint_of(v)
    return frozenset(found)
