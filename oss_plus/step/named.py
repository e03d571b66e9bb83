"""Optimizers whose constructor takes ``(name, param)`` pairs (adam-mini's
``Adam_mini(named_parameters, ...)``): OSS hands them the names it was given, and checks
that they keep the groups it hands them (issue 54)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["NEEDS_NAMES", "OWN_GROUPS", "check_named", "construct", "takes_named"]

#: TypeError: the constructor takes ``(name, param)`` pairs and the user gave OSS none.
NEEDS_NAMES = (
    "{name} takes named parameters (its first argument is {arg!r}: (name, param) pairs, as "
    "model.named_parameters() gives), but OSS was given params without names: pass "
    "OSS(model.named_parameters(), optim={name}, ...)"
)
#: TypeError: the constructor builds groups of its own from the names.
OWN_GROUPS = (
    "{name} builds param groups of its own from the parameter names ({built} groups from the "
    "{given} OSS handed it), and OSS steps an inner optimizer whose groups are the ones it "
    "hands it (one per OSS param group, so that hyperparameters, schedulers and state dicts "
    "map onto each other): OSS cannot shard {name}; use it without oss_plus"
)


def takes_named(constructor: Any) -> str | None:
    """The name of the constructor's first argument when it asks for named parameters
    (adam-mini's ``Adam_mini(named_parameters, ...)``), else None."""
    try:
        first = next(iter(inspect.signature(constructor).parameters.values()), None)
    except (TypeError, ValueError):
        return None
    return first.name if first is not None and "named" in first.name else None


def construct(
    constructor: Callable[..., Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> Optimizer:
    """Call ``constructor`` over ``groups``; one that takes ``(name, param)`` pairs
    (:func:`takes_named`) gets the groups' ``param_names`` with their params (one group:
    the pairs alone, as ``model.named_parameters()`` gives them).

    Raises:
        TypeError: it takes pairs and the groups have no names (:data:`NEEDS_NAMES`).
    """
    arg = takes_named(constructor)
    if arg is None:
        return constructor(groups, **defaults)
    name = getattr(constructor, "__name__", type(constructor).__name__)
    if any("param_names" not in g for g in groups):
        raise TypeError(NEEDS_NAMES.format(name=name, arg=arg))
    pairs = [
        {**{k: v for k, v in g.items() if k != "param_names"},
         "params": list(zip(g["param_names"], g["params"]))}
        for g in groups
    ]  # fmt: skip
    return constructor(pairs if len(pairs) > 1 else pairs[0]["params"], **defaults)


def check_named(
    constructor: Callable[..., Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> None:
    """For a constructor that takes ``(name, param)`` pairs: build it once over every param
    (``groups``: the global groups; no state is made) and check that it keeps them, so every
    rank raises the same error whatever its shard.

    Raises:
        TypeError: no names (:data:`NEEDS_NAMES`), or groups of its own (:data:`OWN_GROUPS`).
    """
    if takes_named(constructor) is not None:
        check_kept_groups(constructor, construct(constructor, groups, defaults), groups)


def check_kept_groups(
    constructor: Callable[..., Optimizer], inner: Any, groups: list[dict[str, Any]]
) -> None:
    """Raise :data:`OWN_GROUPS` unless ``inner`` kept ``groups`` (their params, in order)."""
    built = [list(g["params"]) for g in inner.param_groups]
    if len(built) != len(groups) or any(
        len(b) != len(g["params"]) or any(x is not y for x, y in zip(b, g["params"]))
        for b, g in zip(built, groups)
    ):
        name = getattr(constructor, "__name__", type(constructor).__name__)
        raise TypeError(OWN_GROUPS.format(name=name, built=len(built), given=len(groups)))
