"""Optimizer state held as tensor subclasses (torchao's low-bit states): which classes travel,
how they split into plain tensors and how they are rebuilt. Pure: no I/O, no collectives.

torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` keep their moments as tensor
subclasses (``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``) that implement torch's
traceable wrapper-subclass protocol: ``t.__tensor_flatten__()`` returns the names of its
inner tensors and a *context* (plain values: a bool, a dtype, a shape), and
``cls.__tensor_unflatten__(inner, context, size, stride)`` builds it back. oss_plus moves and
saves such a value as its inner plain tensors plus JSON data (:mod:`oss_plus.state.nested`
writes the node ``{"subclass": {...}}``): the collectives, safetensors files and DCP only
ever see plain tensors.

Rebuilding calls a class, so only classes on an allow-list are rebuilt: the torchao state
classes of :data:`KNOWN_STATE_CLASSES` (imported from this fixed table, never from a name
read from a file or a peer) and those registered with :func:`register_state_class`. A
subclass without the protocol, or not on the list, raises :class:`TypeError` where it would
be sent or saved (on every rank, before anything moves); an unknown class name in data
raises :class:`ValueError` that names it.

Example:
    >>> is_plain(torch.zeros(2)), is_plain(torch.nn.Parameter(torch.zeros(2)))
    (True, True)
    >>> class_name(torch.Tensor)
    'torch.Tensor'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "KNOWN_STATE_CLASSES",
    "class_name",
    "clone_tensor",
    "is_plain",
    "known_class",
    "rebuild",
    "register_state_class",
    "split",
]

#: Optimizer-state classes rebuilt without registration: their name -> (module, attribute).
#: The module is imported from this table only (torchao is needed where one is rebuilt).
KNOWN_STATE_CLASSES: dict[str, tuple[str, str]] = {
    f"torchao.optim.subclass_{kind}.{cls}": (f"torchao.optim.subclass_{kind}", cls)
    for kind, cls in (
        ("8bit", "OptimState8bit"),
        ("4bit", "OptimState4bit"),
        ("fp8", "OptimStateFp8"),
    )
}

#: Classes registered with :func:`register_state_class`, by :func:`class_name`.
_REGISTERED: dict[str, type] = {}

#: Raised for a subclass that cannot travel (``where``, ``kind``, ``reason``).
CANNOT_TRAVEL = (
    "optimizer state {where} is a {kind}, a tensor subclass {reason}; oss_plus moves and saves "
    "tensor subclasses that implement __tensor_flatten__ / __tensor_unflatten__ and are known "
    "optimizer-state classes (torchao's OptimState8bit, OptimState4bit, OptimStateFp8, or one "
    "registered with oss_plus.register_state_class)"
)
#: Raised when data names a class that is not on the allow-list (``where``, ``name``).
UNKNOWN_CLASS = (
    "{where}: the state names tensor subclass {name!r}, which is not a known optimizer-state "
    "class: oss_plus rebuilds only torchao's OptimState8bit, OptimState4bit, OptimStateFp8 and "
    "classes registered with oss_plus.register_state_class (it never imports a name "
    "read from data); register the class in this process before loading"
)

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain tensor (or a ``Parameter``), not a tensor subclass."""
    return type(tensor) in _PLAIN


def class_name(cls: type) -> str:
    """The name a class is written and allow-listed under: ``module.qualname``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_protocol(cls: type) -> bool:
    return callable(getattr(cls, "__tensor_flatten__", None)) and callable(
        getattr(cls, "__tensor_unflatten__", None)
    )


def register_state_class(cls: type) -> type:
    """Allow optimizer state of tensor subclass ``cls`` to travel and be rebuilt (a decorator).

    ``cls`` must implement ``__tensor_flatten__`` / ``__tensor_unflatten__`` with a context of
    plain values (None, bool, int, float, str, ``torch.dtype``, ``torch.Size`` and
    lists/tuples/dicts of them). Register it in every process that moves, saves or loads it.

    Raises:
        TypeError: ``cls`` is not a tensor subclass with that protocol.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)) or cls in _PLAIN:
        raise TypeError(f"register_state_class() takes a torch.Tensor subclass, got {cls!r}")
    if not _has_protocol(cls):
        raise TypeError(
            f"{class_name(cls)} does not implement __tensor_flatten__ / __tensor_unflatten__, "
            "so its state cannot be split into plain tensors"
        )
    _REGISTERED[class_name(cls)] = cls
    return cls


def known_class(name: str) -> type | None:
    """The allow-listed class called ``name``, or None (torchao's are imported on demand).

    Raises:
        ValueError: ``name`` is a torchao state class but torchao cannot be imported here.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in KNOWN_STATE_CLASSES:
        return None
    module, attr = KNOWN_STATE_CLASSES[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"the state holds {name}, which needs torchao: pip install torchao ({exc})"
        ) from None


def split(tensor: torch.Tensor, where: str) -> tuple[str, list[tuple[str, torch.Tensor]], Any]:
    """Split a subclass state value into ``(class name, [(attr, inner tensor)], context)``.

    Inner tensors are returned as they are (not copied); they may be subclasses themselves.

    Raises:
        TypeError: the class lacks the protocol or is not on the allow-list (names
            ``where`` and the class).
    """
    cls = type(tensor)
    name = class_name(cls)
    if not _has_protocol(cls):
        reason = "without __tensor_flatten__ / __tensor_unflatten__"
        raise TypeError(CANNOT_TRAVEL.format(where=where, kind=name, reason=reason))
    known = known_class(name)
    if known is not cls:
        reason = (
            "that is not a known optimizer-state class"
            if known is None
            else f"named like the known class {name} but not it"
        )
        raise TypeError(CANNOT_TRAVEL.format(where=where, kind=name, reason=reason))
    attrs, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return name, [(attr, getattr(tensor, attr)) for attr in attrs], context


def rebuild(
    name: str,
    inner: Mapping[str, torch.Tensor],
    context: Any,
    size: Sequence[int],
    stride: Sequence[int],
    where: str,
) -> torch.Tensor:
    """Build the subclass ``name`` from its inner tensors and context (allow-list only).

    Raises:
        ValueError: ``name`` is not on the allow-list (the message names it).
    """
    cls = known_class(name)
    if cls is None:
        raise ValueError(UNKNOWN_CLASS.format(where=where, name=name))
    unflatten: Callable[..., torch.Tensor] = cls.__tensor_unflatten__  # type: ignore[attr-defined]
    return unflatten(dict(inner), context, torch.Size(size), tuple(stride))


def clone_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` that shares no memory with it; a subclass is rebuilt around
    copies of its inner tensors (torchao's state classes do not implement ``clone``)."""
    if is_plain(tensor):
        return tensor.clone()
    name, inner, context = split(tensor, "value")
    copies = {attr: clone_tensor(t) for attr, t in inner}
    return rebuild(name, copies, context, tensor.shape, tensor.stride(), "value")
