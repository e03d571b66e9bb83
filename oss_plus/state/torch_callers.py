"""Recognising torch's DCP state-dict functions when they call :class:`oss_plus.OSS`.

torch's ``torch.distributed.checkpoint.state_dict`` reaches the optimizer through its
ordinary methods: ``_get_optim_state_dict`` calls ``state_dict()``,
``_load_optim_state_dict`` calls ``load_state_dict()`` and ``_init_optim_state`` reads
``state``. :func:`torch_options` tells, from the first caller frame outside oss_plus,
whether one of them is the caller (compared by code object, so a user's function of the
same name is not), and hands over that call's options (torch's ``_StateDictInfo``);
:func:`for_full_load` tells the ``state_dict()`` that torch's full-state load asks for as
a template. They are private torch functions (``docs/portability.md``,
``tests/test_torch_api.py``): on a torch without them nothing is recognised and the plain
methods run. What :class:`~oss_plus.OSS` answers them is :mod:`oss_plus.state.dcp`.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["GET", "LOAD", "PROBE", "for_full_load", "from_checkpoint", "torch_options"]

#: torch's callers: ``state_dict()`` from ``get_*state_dict``, ``load_state_dict()`` from
#: ``set_*state_dict``, ``state`` read by ``_init_optim_state``.
GET, LOAD, PROBE = "_get_optim_state_dict", "_load_optim_state_dict", "_init_optim_state"


def _code(name: str) -> Any | None:
    """The code object of torch's ``state_dict`` module function ``name`` (unwrapped)."""
    try:
        from torch.distributed.checkpoint import state_dict as torch_sd
    except ImportError:  # pragma: no cover - torch without DCP
        return None
    fn = getattr(torch_sd, name, None)
    fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__code__", None)


def _torch_frame(start: FrameType | None) -> FrameType | None:
    """The first frame above ``start`` that is not oss_plus's own code."""
    frame = start
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("oss_plus"):
        frame = frame.f_back
    return frame


def torch_options(kind: str) -> Any | None:
    """Return torch's ``_StateDictInfo`` when the call comes from torch's function ``kind``.

    ``kind`` is :data:`GET` (``state_dict()`` from ``get_*state_dict``), :data:`LOAD`
    (``load_state_dict()`` from ``set_*state_dict``) or :data:`PROBE` (``state`` read by
    ``_init_optim_state``; returns True). None: another caller (a user, a framework).
    """
    frame = _torch_frame(sys._getframe(1))
    code = _code(kind)
    if frame is None or code is None or frame.f_code is not code:
        return None
    return True if kind == PROBE else frame.f_locals.get("info", True)


def from_checkpoint() -> bool:
    """Whether the first caller outside oss_plus is code of ``torch.distributed.checkpoint``
    (recognised by :func:`torch_options` or not: a torch whose functions differ)."""
    frame = _torch_frame(sys._getframe(1))
    name = str(frame.f_globals.get("__name__", "")) if frame is not None else ""
    return name.startswith("torch.distributed.checkpoint")


def for_full_load() -> bool:
    """Whether ``state_dict()`` is called by torch's ``set_*state_dict`` with
    ``full_state_dict=True`` (``_load_optim_state_dict`` -> ``_get_optim_state_dict``), which
    takes the result as the template the whole state is distributed into."""
    frame, load = _torch_frame(sys._getframe(1)), _code(LOAD)
    for _ in range(3):  # above it: torch.no_grad's wrapper, then torch's load
        frame = frame.f_back if frame is not None else None
        if frame is not None and frame.f_code is load:
            return True
    return False
