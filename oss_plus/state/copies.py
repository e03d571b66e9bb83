"""Copies of an :class:`oss_plus.OSS`: refused at the call, with what to do instead.

A plain ``torch.optim`` optimizer holds all of its state, so ``copy.deepcopy`` (with its
model, in one call) or ``pickle`` / ``torch.save`` give an optimizer that steps exactly like
the original. An ``OSS`` holds only this rank's shard, its sync layout and its process group
(which neither pickles nor deep-copies): a copy could only be an empty shell (before issue 55,
a deep copy had no state entries, no ``optim``, and raised ``AttributeError`` at its first
``state_dict()``). So ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` of an
``OSS`` (and of both adapters) raise TypeError (:data:`NOT_COPYABLE`) naming the ways to keep
or move the state: a consolidated ``state_dict()``, a checkpoint, or a new ``OSS`` over the
copied model's params loading that state. Not collective.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["NOT_COPYABLE", "refuse_deepcopy", "refuse_reduce"]

#: Raised by ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` of an OSS.
NOT_COPYABLE = (
    "{kind} cannot be {how}: this rank holds only its shard of the optimizer state, and its "
    "process group cannot be copied. To keep the state, call consolidate_state_dict() on "
    "every rank and save state_dict() (a plain torch.optim state dict), or "
    "oss_plus.save_checkpoint(opt, path) on every rank; to copy a training run, build a new "
    "{kind} over the copied model's params on every rank and load that state into it"
)


def refuse_deepcopy(self: Any, memo: dict[int, Any]) -> NoReturn:
    """``__deepcopy__`` of :class:`oss_plus.OSS`: raise :data:`NOT_COPYABLE`."""
    raise TypeError(NOT_COPYABLE.format(kind=type(self).__name__, how="deep-copied"))


def refuse_reduce(self: Any, protocol: Any = None) -> NoReturn:
    """``__reduce_ex__`` of :class:`oss_plus.OSS` (``pickle``, ``torch.save``,
    ``copy.copy``): raise :data:`NOT_COPYABLE`."""
    how = "pickled or copied (pickle, torch.save, copy.copy)"
    raise TypeError(NOT_COPYABLE.format(kind=type(self).__name__, how=how))
