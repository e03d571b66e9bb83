"""Whether the ranks hold the same values where one state dict can keep only one.

A consolidated state dict, a consolidated checkpoint and any load at another world size or
plan keep one value of each param-group hyperparameter and of each extra of the inner
optimizer's ``state_dict()`` (:mod:`oss_plus.state.extras`). Each rank's inner optimizer
writes its own: most write the same on every rank (a step count, a learning rate), but an
optimizer that reduces over its own shard keeps a share of a sum (dadaptation's
``DAdaptAdam(fsdp_in_use=True)``: ``numerator_weighted`` in its param groups). Keeping one
rank's value would resume a different run, silently; :func:`check_agreed` raises instead,
on every rank, naming the values that differ (every rank compares the same gathered
digests, so every rank raises the same error without another collective).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from oss_plus.runtime.dist import all_gather_bytes, group_members, name_rank
from oss_plus.state.extras import Extras
from oss_plus.state.nested import flatten_value, unflatten_value

__all__ = [
    "RANKS_DIFFER",
    "as_built_on_rank_0",
    "check_agreed",
    "compare",
    "differing",
    "digest_of",
    "digests",
    "raise_differing",
]

#: Raised when the ranks hold different values where one state dict keeps one.
RANKS_DIFFER = (
    "{what}: the ranks of the group hold different values of {items} ({values}), where a "
    "single state dict can keep only one; keeping one rank's would resume a different run. "
    "The inner optimizer keeps a value of its own on each rank (e.g. a share of a sum over "
    "its shard): save a sharded checkpoint (save_checkpoint(opt, path), which keeps each "
    "rank's value) and resume it at the same world size, or make the optimizer write the "
    "same value on every rank"
)


def digest_of(value: Any) -> str:
    """A digest of ``value``: its JSON skeleton and its tensors' dtypes, shapes and bytes
    (of its ``repr`` when it has no JSON form)."""
    try:
        skeleton, tensors = flatten_value(value)
    except TypeError:
        return hashlib.sha256(repr(value).encode()).hexdigest()
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True, default=str).encode())
    for t in tensors:
        data = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    """``value``'s JSON skeleton when it holds no tensor (else None): how a value as built
    travels to the ranks that keep another (:func:`as_built_on_rank_0`)."""
    try:
        skeleton, tensors = flatten_value(value)
    except TypeError:
        return None
    return None if tensors else {"value": skeleton}


def digests(
    extras: Extras | None,
    param_groups: Sequence[Mapping[str, Any]],
    initial: Sequence[Mapping[str, Any]] = (),
) -> dict[str, tuple[Any, ...]]:
    """Name -> (digest, short text, as built, plain form, group, key) of every value one
    state dict keeps once: each hyperparameter of each group (as built: it still equals
    ``initial``, the value the inner optimizer had when it was built), and each extra of
    the inner optimizer (group and key None)."""
    out: dict[str, tuple[Any, ...]] = {}
    for g, group in enumerate(param_groups):
        built = initial[g] if g < len(initial) else {}
        for key, value in group.items():
            if key not in ("params", "param_names"):
                digest = digest_of(value)
                same = key in built and digest_of(built[key]) == digest
                name = f"param group {g}'s {key!r}"
                out[name] = (digest, _short(value), same, _plain(value), g, key)
    if extras is not None:
        whole = digest_of(extras.to_value())
        out["the inner optimizer's state_dict() extras"] = (whole, "", False, None, None, None)
        for key, value in extras.tree.items():
            name = f"its state_dict()'s {key!r}"
            out[name] = (digest_of(value), _short(value), False, None, None, None)
    return out


def as_built_on_rank_0(
    per_rank: Sequence[Mapping[str, Sequence[Any]]],
) -> dict[tuple[int, str], Any]:
    """The group values that differ between the ranks but are as built on every rank, as
    group rank 0 holds them, by (group, key): what a consolidated dict keeps on every rank,
    as a checkpoint's index does (None where such a value holds a tensor: it cannot travel
    this way, and is then reported by :func:`differing`)."""
    out = {}
    for name, entry in per_rank[0].items():
        if entry[4] is None or entry[3] is None:
            continue
        if len({tuple(m.get(name, ("",)))[0] for m in per_rank}) > 1:
            out[(int(entry[4]), str(entry[5]))] = unflatten_value(entry[3]["value"], [])
    return out


def differing(per_rank: Sequence[Mapping[str, Sequence[Any]]]) -> list[str]:
    """The names whose digests are not the same on every rank (in the first rank's order,
    then the others'), but those every rank still holds as built: a value the inner
    optimizer derives from its own shard when it is built (heavyball's ``param_count``) is
    its configuration, not trained state, as every optimizer built over that shard has it.

    Example:
        >>> differing([{"a": ["1", "", False, 1], "b": ["2", "", True, 2]},
        ...            {"a": ["3", "", False, 3], "b": ["4", "", True, 4]}])
        ['a']
    """
    names = list(dict.fromkeys(n for mine in per_rank for n in mine))
    absent = ["", "absent", False, None]
    return [
        n
        for n in names
        if len({m.get(n, absent)[0] for m in per_rank}) > 1
        and not all(m.get(n, absent)[2] and m.get(n, absent)[3] is not None for m in per_rank)
    ]


def compare(
    extras: Extras | None,
    param_groups: Sequence[Mapping[str, Any]],
    initial: Sequence[Mapping[str, Any]],
    group: Any,
) -> tuple[list[str], list[dict[str, list[Any]]]]:
    """The names of the values that differ between the ranks (:func:`differing`) and every
    rank's digests (the same on every rank).

    .. warning:: Collective: call on every rank of ``group``.
    """
    mine = {k: list(v) for k, v in digests(extras, param_groups, initial).items()}
    per_rank = [json.loads(t) for t in all_gather_bytes(json.dumps(mine).encode(), group)]
    return differing(per_rank), per_rank


def raise_differing(
    names: Sequence[str], per_rank: Sequence[Mapping[str, Sequence[Any]]], group: Any, what: str
) -> None:
    """Raise :data:`RANKS_DIFFER` for ``names`` (every rank calls it with the same ones).

    Raises:
        ValueError: always.
    """
    detailed = [n for n in names if "extras" not in n] or list(names)
    members = group_members(group)
    shown = detailed[0]
    values = ", ".join(
        f"{name_rank(members, r)}: {(m.get(shown) or ['', 'absent'])[1] or 'differs'}"
        for r, m in enumerate(per_rank)
    )
    raise ValueError(
        RANKS_DIFFER.format(what=what, items=", ".join(detailed), values=f"{shown}: {values}")
    )


def check_agreed(
    extras: Extras | None,
    param_groups: Sequence[Mapping[str, Any]],
    initial: Sequence[Mapping[str, Any]],
    group: Any,
    what: str,
) -> dict[tuple[int, str], Any]:
    """Raise on every rank of ``group`` when the ranks hold different values (see the module
    docstring); else return the values as built that differ, as rank 0 holds them
    (:func:`as_built_on_rank_0`).

    Raises:
        ValueError: :data:`RANKS_DIFFER`, the same on every rank.

    .. warning:: Collective: call on every rank of ``group``.
    """
    names, per_rank = compare(extras, param_groups, initial, group)
    if names:
        raise_differing(names, per_rank, group, what)
    return as_built_on_rank_0(per_rank)
