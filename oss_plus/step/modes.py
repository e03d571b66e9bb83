"""Optimizer modes (schedule-free's ``train()`` / ``eval()``) through a sharded optimizer.

A schedule-free optimizer (schedulefree's ``AdamWScheduleFree``, ``SGDScheduleFree``,
``RAdamScheduleFree``, pytorch_optimizer's ``ScheduleFreeAdamW``, ...) trains at one point
``y`` and evaluates at another, ``x``; ``eval()`` moves every param from ``y`` to ``x`` and
``train()`` back, each from the param's own state (``z``), which only its owner holds under
``OSS``. :class:`Modes`, a mixin of :class:`oss_plus.OSS`, runs the inner optimizer's method
the way :meth:`oss_plus.OSS.step` runs its ``step``: hyperparameters copied to the inner
groups first (schedule-free keeps ``train_mode`` there) and back after, the exact values
stepped under a compressed wire (:meth:`oss_plus.wire.sync.BucketSync.restore`), then one
blocking sync brings every replica the owners' swapped params and raises on every rank what
any rank raised.

``train`` and ``eval`` exist on an ``OSS`` exactly when its inner optimizer has them:
``hasattr(opt, "train")`` is what the HF ``Trainer`` and Accelerate test before calling them
(the ``Trainer`` calls ``train()`` at every training step). A call in the mode the optimizer
is already in is free: no collective, no sync, when the mode can be read on the host (a bool
``train_mode`` in every param group, as schedulefree and pytorch_optimizer keep it, or on
the optimizer itself, as ``ScheduleFreeWrapper`` keeps it); the mode is then the same on
every rank, so every rank skips alike. Otherwise every call is a sync.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label
from oss_plus.state.index import copy_hyper
from oss_plus.wire.sync import BucketSync

__all__ = ["MODE_METHODS", "NO_MODE", "Modes", "carry_mode", "current_mode"]

#: The mode methods forwarded to the inner optimizer, and the mode each one sets
#: (True: training).
MODE_METHODS = {"train": True, "eval": False}

#: AttributeError when the inner optimizer has no such method (``hasattr`` is then False).
NO_MODE = (
    "{name}() is not available: the inner optimizer {cls} has no {name}() (only optimizers "
    "with modes, such as schedule-free ones, have it); OSS forwards train()/eval() only to "
    "an inner optimizer that has them"
)


def current_mode(param_groups: list[dict[str, Any]], inner: Any) -> bool | None:
    """The mode as the host can read it: True (training), False (evaluating) or None
    (unknown: every group's ``train_mode`` is not one bool, and ``inner`` has none).

    Example:
        >>> current_mode([{"train_mode": True}, {"train_mode": True}], None)
        True
        >>> current_mode([{"lr": 0.1}], None) is None
        True
    """
    flags = {g.get("train_mode") for g in param_groups}
    if len(flags) == 1:
        (flag,) = flags
        if isinstance(flag, bool):
            return flag
    flag = getattr(inner, "train_mode", None)
    return flag if isinstance(flag, bool) else None


def carry_mode(old: Any, new: Any) -> None:
    """Give a rebuilt inner optimizer ``new`` the mode ``old`` kept on itself (a bool
    ``train_mode`` attribute, as ``ScheduleFreeWrapper`` keeps it: a mode kept in the param
    groups comes with the groups)."""
    flag = getattr(old, "train_mode", None)
    if isinstance(flag, bool) and isinstance(getattr(new, "train_mode", None), bool):
        new.train_mode = flag


class Modes:
    """``train()`` / ``eval()`` forwarded to the inner optimizer (module doc); a mixin of
    :class:`oss_plus.OSS`, using only its public members."""

    # provided by oss_plus.OSS
    group: Any
    param_groups: list[dict[str, Any]]
    settle: Callable[[], None]
    drop_consolidated: Callable[[], None]
    if TYPE_CHECKING:  # properties of oss_plus.OSS

        @property
        def optim(self) -> Optimizer: ...
        @property
        def sync(self) -> BucketSync: ...
        @property
        def local_shard(self) -> Any: ...
        @property
        def wire_dtype(self) -> torch.dtype | None: ...
        @property
        def step_count(self) -> int: ...

    @property
    def train(self) -> Callable[[], None]:
        """Put the inner optimizer in training mode, on every replica (schedule-free: every
        param moves to the point the optimizer trains at, ``y``).

        Present only when the inner optimizer has ``train()`` (``hasattr`` is False
        otherwise, so frameworks that call it when present work unchanged). Every rank then
        holds the params the unsharded optimizer's ``train()`` gives, bit for bit in fp32
        (on a compressed wire: those rounded, the owners keeping the exact values). A call in
        training mode already does nothing and communicates nothing (module doc).

        Raises:
            AttributeError: the inner optimizer has no ``train()``.
            Exception: what the inner ``train()`` raised on any rank, on every rank (the
                sync completes first).

        Example:
            >>> opt = OSS(model.parameters(), optim=AdamWScheduleFree, lr=1e-3)  # doctest: +SKIP
            >>> opt.train(); train_epoch(); opt.eval(); evaluate(); save()  # doctest: +SKIP

        .. warning:: Collective: call on every rank of ``group``.
        """
        return self._mode_method("train")

    @property
    def eval(self) -> Callable[[], None]:
        """Put the inner optimizer in evaluation mode, on every replica (schedule-free: every
        param moves to the averaged point ``x``, the one to evaluate and save).

        Present only when the inner optimizer has ``eval()``; otherwise as :attr:`train`.

        Raises:
            AttributeError: the inner optimizer has no ``eval()``.
            Exception: what the inner ``eval()`` raised on any rank, on every rank.

        .. warning:: Collective: call on every rank of ``group``.
        """
        return self._mode_method("eval")

    def _mode_method(self, name: str) -> Callable[[], None]:
        inner = self.optim
        if not callable(getattr(inner, name, None)):
            raise AttributeError(NO_MODE.format(name=name, cls=type(inner).__name__))
        return functools.partial(self._switch_mode, name)

    def _switch_mode(self, name: str) -> None:
        if current_mode(self.param_groups, self.optim) is MODE_METHODS[name]:
            return  # read on the host, the same on every rank: nobody syncs
        with _arrival.entry(
            self.group, f"{name}()", steps=self.step_count
        ):  # a call on some ranks raises there
            self.settle()  # the last step's sync (left in flight after attach()) lands first
            self._swap(name)
        self.drop_consolidated()

    def _swap(self, name: str) -> None:
        sync, wire, inner = self.sync, self.wire_dtype, self.optim
        copy_hyper(self.param_groups, inner.param_groups)
        redirect: Any = contextlib.nullcontext()
        if isinstance(sync, BucketSync):  # the owners swap their exact values
            redirect = sync.restore(wire, stepped=self.local_shard.stepped)
        with label(f"oss_plus::{name}"), redirect:
            _, error = _dist.capture(getattr(inner, name))
        copy_hyper(inner.param_groups, self.param_groups)
        sync.sync(wire, error)  # every replica gets the owners' params; raises on every rank
