"""The param groups of a checkpoint against the optimizer that loads them: pure, no I/O.

:func:`check_groups` is run by :func:`~oss_plus.checkpoint.load_checkpoint` before any
state changes. Every hyperparameter of the inner optimizer (the keys of its ``defaults``)
must be in every saved group with a value of its type; keys the optimizer does not know
are kept, as torch's ``load_state_dict`` keeps them (a scheduler's ``initial_lr``). A key
the class's own ``__setstate__`` fills in for state dicts of older torch versions
(``Adam``'s ``decoupled_weight_decay``) may be missing: it gets that value, as in torch.
A checkpoint of another optimizer class is refused: with a message naming both classes
when its groups do not fit (``SGD`` into ``AdamW``), and unless ``allow_other_optimizer``
when they do (``Adam`` into ``AdamW``), which then loads every saved hyperparameter as saved.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from oss_plus.checkpoint.format import Index
from oss_plus.state.index import own_group_keys

__all__ = ["OTHER_OPTIMIZER", "check_groups", "group_problems"]

logger = logging.getLogger(__name__)

#: Message for a checkpoint of another optimizer class whose groups fit the loading one.
OTHER_OPTIMIZER = (
    "{where} was saved from a {saved} optimizer but is being loaded into a {mine}: its "
    "param groups hold {saved}'s hyperparameters ({differ}), which would replace yours. "
    "Load it into a {saved} optimizer, or pass load_checkpoint(..., "
    "allow_other_optimizer=True) to load every saved hyperparameter as saved"
)
#: Message for a checkpoint of another optimizer class whose groups do not fit.
INCOMPATIBLE = (
    "{where} was saved from a {saved} optimizer and cannot be loaded into a {mine}: "
    "{problem}. Load it into a {saved} optimizer over the same model"
)
#: Message for a saved group that does not fit the loading optimizer's hyperparameters.
BAD_GROUP = (
    "{where}: {problem}. The index is damaged or was written for another optimizer; restore "
    "it from a backup or re-save the checkpoint"
)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _fits(value: Any, reference: Any) -> bool:
    """Whether ``value`` has the type of ``reference`` (a default or the live value)."""
    if reference is None:
        return True
    if isinstance(reference, bool):
        return isinstance(value, bool)
    if isinstance(reference, (int, float, torch.Tensor)):
        return isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool)
    if isinstance(reference, tuple):
        return (
            isinstance(value, tuple)
            and len(value) == len(reference)
            and all(_fits(v, r) for v, r in zip(value, reference))
        )
    if isinstance(reference, (str, list, dict)):
        return isinstance(value, type(reference))
    return True


def _filled(cls: type, defaults: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
    """``group`` as ``cls.__setstate__`` completes it (torch's ``load_state_dict`` does)."""
    probe: Any = object.__new__(cls)
    body = {"defaults": dict(defaults), "state": {}, "param_groups": [dict(group, params=[])]}
    try:
        probe.__setstate__(body)
        filled = probe.param_groups[0]
    except Exception:  # noqa: BLE001 - a class whose __setstate__ needs more: fill nothing
        return dict(group)
    return {k: v for k, v in filled.items() if k != "params"} | {"params": group["params"]}


def group_problems(
    groups: Sequence[Mapping[str, Any]], inner: Any, live: Sequence[Mapping[str, Any]]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Check saved ``groups`` against ``inner``'s ``defaults`` (``live``: its own groups).

    Returns:
        The problems (a missing or mistyped hyperparameter, naming the key and the group),
        and the groups completed by the class's ``__setstate__``.
    """
    cls, defaults = type(inner), dict(getattr(inner, "defaults", {}) or {})
    own = own_group_keys(inner)  # a class's own state_dict() may drop keys (heavyball's _)
    problems, completed = [], []
    for g, saved in enumerate(groups):
        group = _filled(cls, defaults, saved)
        completed.append(group)
        mine = live[g] if g < len(live) else {}
        kept = own[g] if own is not None and g < len(own) else None
        for key, default in defaults.items():
            if kept is not None and key not in kept:
                continue  # not saved by the class itself: the loading class's value stays
            if key not in group:
                problems.append(
                    f"param group {g} has no {key!r}, a hyperparameter of {cls.__qualname__} "
                    f"(yours is {mine.get(key, default)!r})"
                )
            elif not (_fits(group[key], default) or _fits(group[key], mine.get(key, default))):
                problems.append(
                    f"param group {g} key {key!r} is {group[key]!r} "
                    f"({type(group[key]).__name__}), but {cls.__qualname__} expects a value "
                    f"like {mine.get(key, default)!r}"
                )
    return problems, completed


def check_groups(
    index: Index, optimizer: Any, where: str, allow_other_optimizer: bool = False
) -> list[dict[str, Any]]:
    """Check the param groups of ``index`` against ``optimizer`` (an OSS); return them.

    Returns:
        The groups to load (every saved key, and those the class's ``__setstate__`` fills).

    Raises:
        ValueError: a missing or mistyped hyperparameter, or another optimizer class
            (:data:`INCOMPATIBLE`, or :data:`OTHER_OPTIMIZER` unless
            ``allow_other_optimizer``); the message names the file, the group and the key.
    """
    inner = optimizer.optim
    problems, groups = group_problems(index.param_groups, inner, optimizer.param_groups)
    saved, mine = index.optimizer, _name(type(inner))
    other = saved is not None and saved != mine
    if other and problems:
        problem = "; ".join(problems[:3]) + (f" ({len(problems)} in all)" if problems[3:] else "")
        raise ValueError(INCOMPATIBLE.format(where=where, saved=saved, mine=mine, problem=problem))
    if problems:
        raise ValueError(BAD_GROUP.format(where=where, problem=problems[0]))
    if other and not allow_other_optimizer:
        differ = _differences(groups, optimizer.param_groups)
        raise ValueError(OTHER_OPTIMIZER.format(where=where, saved=saved, mine=mine, differ=differ))
    if other:
        logger.warning("loading %s, saved from a %s optimizer, into a %s", where, saved, mine)
    return groups


def _differences(groups: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]]) -> str:
    """The saved hyperparameters that differ from the live ones, as ``key: live -> saved``."""
    shown = []
    for g, (saved, mine) in enumerate(zip(groups, live)):
        for key, value in saved.items():
            if key != "params" and key in mine and not _same(mine[key], value):
                shown.append(f"group {g} {key}: {mine[key]!r} -> {value!r}")
    return ", ".join(shown[:4]) or "none differ from yours now"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError):  # tensors of several elements
        return a is b
