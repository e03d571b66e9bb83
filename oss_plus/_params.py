"""Validation and normalisation of what users pass as ``params`` and ``optim``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

EMPTY_PARAMS = "oss_plus.OSS got an empty parameter list: pass model.parameters() or param groups"


def check_optim_class(optim: Any) -> None:
    """Raise TypeError unless ``optim`` builds a ``torch.optim.Optimizer``."""
    if isinstance(optim, Optimizer):
        raise TypeError(
            f"optim must be an optimizer class such as torch.optim.Adam, got an instance of "
            f"{type(optim).__name__}: pass the class and its arguments, "
            f"OSS(params, optim={type(optim).__name__}, lr=...)"
        )
    if isinstance(optim, type):
        if not issubclass(optim, Optimizer):
            raise TypeError(
                f"optim must be a subclass of torch.optim.Optimizer, got class {optim.__name__}"
            )
    elif not callable(optim):
        raise TypeError(f"optim must be an optimizer class such as torch.optim.Adam, got {optim!r}")


def normalize_params(params: Any) -> list[dict[str, Any]]:
    """Return ``params`` as a list of param-group dicts, validated.

    Accepts an iterable (list, generator) of tensors, of ``(name, tensor)`` pairs (as from
    ``named_parameters()``), or of group dicts whose ``params`` are any of those.

    Raises:
        TypeError: ``params`` is a single tensor, not iterable, or holds a non-tensor.
        ValueError: empty, a sparse param, or a param listed twice.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or param groups, got a single tensor: "
            "wrap it in a list, OSS([tensor], ...)"
        )
    if isinstance(params, dict):
        params = [params]
    try:
        items = list(params)
    except TypeError as exc:
        raise TypeError(
            f"params must be an iterable of tensors or param groups, got {type(params).__name__}"
        ) from exc
    if not items:
        raise ValueError(EMPTY_PARAMS)
    if all(isinstance(item, dict) for item in items):
        groups = [dict(item) for item in items]
    elif any(isinstance(item, dict) for item in items):
        raise TypeError("params mixes param-group dicts and tensors: use one or the other")
    else:
        groups = [{"params": items}]
    seen: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param group {g} has no 'params' key")
        members = group["params"]
        if isinstance(members, torch.Tensor):
            members = [members]
        elif isinstance(members, set):
            raise TypeError(f"param group {g}: params must be an ordered sequence, not a set")
        group["params"] = members = list(members)
        for i, item in enumerate(members):
            tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            _check_param(tensor, g, i, seen)
    return groups


def _check_param(tensor: Any, g: int, i: int, seen: dict[int, tuple[int, int]]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"param {i} of group {g} is a {type(tensor).__name__}, not a tensor: "
            "pass model.parameters() or lists of tensors"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(
            f"param {i} of group {g} is a sparse tensor ({tensor.layout}): oss_plus shards "
            "dense parameters only"
        )
    if id(tensor) in seen:
        first = seen[id(tensor)]
        raise ValueError(
            f"param {i} of group {g} is the same tensor as param {first[1]} of group {first[0]}: "
            "list every parameter once"
        )
    seen[id(tensor)] = (g, i)


def describe_params(groups: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Return a short per-group description of every param (shape and dtype)."""
    return [
        [f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}" for p in g["params"]]
        for g in groups
    ]


def fingerprint(description: Iterable[Iterable[str]]) -> int:
    """Return a signed 63-bit hash of a description from :func:`describe_params`."""
    text = "|".join(",".join(group) for group in description)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def first_difference(mine: list[list[str]], other: list[list[str]]) -> str:
    """Describe where two descriptions from :func:`describe_params` differ first."""
    if len(mine) != len(other):
        return f"{len(mine)} param groups here, {len(other)} there"
    for g, (a, b) in enumerate(zip(mine, other)):
        if len(a) != len(b):
            return f"group {g} has {len(a)} params here, {len(b)} there"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"param {i} of group {g} is {x} here, {y} there"
    return "no difference in shapes and dtypes"
