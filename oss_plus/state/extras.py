"""What an inner optimizer's ``state_dict()`` holds beyond per-param state and param groups
(PURE: no collectives, no I/O).

The library carries two parts of a ``torch.optim`` state dict itself: the state of each
param (by flat index, on every state path) and the param groups (the global groups of
:class:`oss_plus.OSS`). An optimizer's ``state_dict()`` may hold more, and :func:`detach`
names it, whatever the class:

* top-level keys besides ``state`` and ``param_groups`` (pytorch_optimizer's ``Ranger21``:
  ``current_lr``, ``lookahead_step``, ``starting_lr``; ``SPAM``: ``warmup``);
* entries of ``state`` not keyed by a param (``SPAM``: ``total_step``, ``current_step``);
* state dicts of the ``torch.optim`` format nested under a top-level key (a wrapper's base
  optimizer: pytorch_optimizer's ``Lookahead``, ``base_optimizer``), and per-param mappings
  keyed by ``(group, position)`` pairs (``Lookahead``'s ``lookahead_state``): their
  per-param entries join each param's state under the key :data:`PREFIX` + the top-level
  key, so they move with it on every path; the rest of them is extra like the above.

The extra part is an :class:`Extras` value (the tree and where the per-param parts were
taken from); :func:`attach` puts a state dict of the ``torch.optim`` format (with prefixed
per-param entries) and an :class:`Extras` back together into the class's own format, at
local positions (the inner optimizer's ``load_state_dict``) or at flat indices (the
consolidated dict, loadable by the plain class).

Example:
    >>> sd = {"state": {0: {"m": 1}, "n": 5}, "param_groups": [{"params": [0]}], "lr0": 2}
    >>> form, extras = detach(sd)
    >>> form
    {'state': {0: {'m': 1}}, 'param_groups': [{'params': [0]}]}
    >>> extras.tree
    {'state': {'n': 5}, 'lr0': 2}
    >>> attach(form, extras) == sd
    True
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oss_plus.state.nested import flatten_value

__all__ = [
    "LEFT_OUT",
    "NODE",
    "PAIRS",
    "PREFIX",
    "Extras",
    "attach",
    "detach",
    "is_torch_form",
    "storable",
]

logger = logging.getLogger(__name__)

#: Prefix of the per-param state keys that hold a nested part's entries.
PREFIX = "oss_plus.sd/"
#: Kind of a nested part: a state dict of the ``torch.optim`` format.
NODE = "node"
#: Kind of a nested part: a mapping keyed by ``(group, position in the group)``.
PAIRS = "pairs"

STATE, GROUPS, PARAMS = "state", "param_groups", "params"

#: Logged (once per process and place) for extras that a file cannot hold.
LEFT_OUT = (
    "%s: %s %s no JSON form (e.g. pickled bytes) and %s left out; the loading optimizer "
    "keeps its own value (docs/checkpoints.md)"
)
_told: set[str] = set()

#: Raised for a state dict in which the library finds no param groups.
NO_GROUPS = (
    "the optimizer state dict has neither 'state' and 'param_groups' (the torch.optim "
    "format) nor such a dict under one of its keys {keys}: oss_plus cannot tell which params "
    "its state belongs to; give it the torch.optim format"
)


@dataclass(frozen=True)
class Extras:
    """The part of an optimizer's ``state_dict()`` that the library does not carry per param.

    Attributes:
        tree: the state dict without its param groups and per-param entries (a nested
            part keeps its other keys; a ``(group, position)`` mapping is left out).
        order: the state dict's top-level keys, in its order.
        top: whether the top level is the ``torch.optim`` format (its per-param entries are
            the param's state itself, not under a :data:`PREFIX` key).
        parts: the nested parts, as (top-level key, :data:`NODE` or :data:`PAIRS`).
    """

    tree: dict[Any, Any]
    order: tuple[Any, ...]
    top: bool = True
    parts: tuple[tuple[Any, str], ...] = ()

    @property
    def empty(self) -> bool:
        """Whether there is nothing to carry: the plain ``torch.optim`` format."""
        return self.top and not self.parts and self.tree == {STATE: {}}

    def names(self) -> list[str]:
        """What is extra, for messages: top-level keys, ``state[...]`` entries not keyed by a
        param, and nested parts.

        Example:
            >>> Extras({"state": {"n": 1}, "lr0": 2}, ("state", "param_groups", "lr0")).names()
            ["state['n']", 'lr0']
        """
        names = [f"state[{k!r}]" for k in self.tree.get(STATE, {})] if self.top else []
        return names + [str(k) for k in self.order if k not in (STATE, GROUPS) or not self.top]

    def storable(self) -> tuple[Extras, list[str]]:
        """These extras without the values that have no JSON form (heavyball writes its
        ``precond_schedule`` pickled, as bytes, and unpickles it in its own load: no file of
        oss_plus holds such bytes), and where they were. A loading optimizer keeps its own
        value of what is left out (its own ``load_state_dict`` sees no such key).
        """
        tree, dropped = _storable(self.tree, "state_dict()")
        return Extras(tree, self.order, self.top, self.parts), dropped

    def to_value(self) -> dict[str, Any]:
        """A plain value (dicts, lists, tuples, tensors) for JSON encoders; see
        :meth:`from_value`."""
        return {
            "tree": self.tree,
            "order": list(self.order),
            "top": self.top,
            "parts": [[key, kind] for key, kind in self.parts],
        }

    @classmethod
    def from_value(cls, value: Any) -> Extras:
        """The :class:`Extras` of :meth:`to_value`'s value.

        Raises:
            ValueError: ``value`` is not of that form.
        """
        try:
            parts = tuple((key, str(kind)) for key, kind in value["parts"])
            if any(kind not in (NODE, PAIRS) for _, kind in parts):
                raise ValueError(f"unknown kinds in {parts}")
            return cls(dict(value["tree"]), tuple(value["order"]), bool(value["top"]), parts)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed optimizer extras ({exc})") from None


def _storable(tree: Mapping[Any, Any], where: str) -> tuple[dict[Any, Any], list[str]]:
    """``tree`` without the values :func:`oss_plus.state.nested.flatten_value` refuses
    (looked for inside dicts), and where they were."""
    kept: dict[Any, Any] = {}
    dropped: list[str] = []
    for key, value in tree.items():
        at = f"{where}[{key!r}]"
        try:
            flatten_value({key: value}, at)
            kept[key] = value
        except TypeError:
            if isinstance(value, Mapping):
                kept[key], inner = _storable(value, at)
                dropped += inner
            else:
                dropped.append(at)
    return kept, dropped


def is_torch_form(value: Any) -> bool:
    """Whether ``value`` is a state dict of the ``torch.optim`` format.

    Example:
        >>> is_torch_form({"state": {}, "param_groups": [{"params": []}]})
        True
        >>> is_torch_form({"lookahead_state": {}})
        False
    """
    if not isinstance(value, Mapping) or not isinstance(value.get(STATE), Mapping):
        return False
    groups = value.get(GROUPS)
    return isinstance(groups, list) and all(
        isinstance(g, Mapping) and isinstance(g.get(PARAMS), list) for g in groups
    )


def _is_pairs(value: Any, ids: Sequence[Sequence[Any]]) -> bool:
    """Whether ``value`` is a non-empty mapping keyed by (group, position) pairs of ``ids``."""
    if not isinstance(value, Mapping) or not value:
        return False
    return all(
        isinstance(k, tuple)
        and len(k) == 2
        and all(type(n) is int for n in k)
        and 0 <= k[0] < len(ids)
        and 0 <= k[1] < len(ids[k[0]])
        and isinstance(v, Mapping)
        for k, v in value.items()
    )


def detach(sd: Mapping[Any, Any]) -> tuple[dict[str, Any], Extras]:
    """Split an optimizer's state dict into the ``torch.optim`` format and its extras.

    The result's ``state`` holds, by the ids its ``param_groups`` list, each param's entries
    (a nested part's under :data:`PREFIX` + its key); its param groups are the top level's,
    or else the first nested part's. Nothing is copied.

    Raises:
        ValueError: no param groups anywhere (:data:`NO_GROUPS`).
    """
    top = is_torch_form(sd)
    nodes = [k for k, v in sd.items() if k not in (STATE, GROUPS) and is_torch_form(v)]
    if not top and not nodes:
        raise ValueError(NO_GROUPS.format(keys=sorted(map(str, sd))))
    groups = sd[GROUPS] if top else sd[nodes[0]][GROUPS]
    ids = [list(g[PARAMS]) for g in groups]
    known = {i for g in ids for i in g}
    state: dict[Any, dict[Any, Any]] = {}
    tree: dict[Any, Any] = {}
    parts: list[tuple[Any, str]] = []
    if top:  # an int key no group lists stays: a param id of another model (validated)
        for key, value in sd[STATE].items():
            if key in known or _is_id(key):
                state[key] = dict(value) if isinstance(value, Mapping) else value
        tree[STATE] = {k: v for k, v in sd[STATE].items() if k not in known and not _is_id(k)}
    for key, value in sd.items():
        if not (key in (STATE, GROUPS) and top):
            kind = _take(key, value, key in nodes, ids, state, tree)
            parts += [(key, kind)] if kind else []
    ordered = {i: state[i] for g in ids for i in g if i in state}
    ordered.update({i: v for i, v in state.items() if i not in ordered})
    form = {STATE: ordered, GROUPS: groups}
    return form, Extras(tree, tuple(sd), top, tuple(parts))


def _take(
    key: Any,
    value: Any,
    node: bool,
    ids: Sequence[Sequence[Any]],
    state: dict[Any, dict[Any, Any]],
    tree: dict[Any, Any],
) -> str | None:
    """Put a top-level ``value`` of a state dict where :func:`detach` keeps it: a nested
    part's per-param entries into ``state`` (its other keys into ``tree``), anything else
    into ``tree``; return the part's kind (None: not a part)."""
    known = {i for g in ids for i in g}
    if node:
        for i, entry in value[STATE].items():
            if i in known:
                state.setdefault(i, {})[PREFIX + str(key)] = entry
        rest = {k: v for k, v in value.items() if k != GROUPS}
        rest[STATE] = {k: v for k, v in value[STATE].items() if k not in known}
        tree[key] = rest
        return NODE
    if _is_pairs(value, ids):
        for (g, n), entry in value.items():
            state.setdefault(ids[g][n], {})[PREFIX + str(key)] = entry
        return PAIRS
    tree[key] = value
    return None


def attach(form: Mapping[str, Any], extras: Extras) -> dict[Any, Any]:
    """The state dict of the optimizer's own format: ``form`` (the ``torch.optim`` format,
    nested parts' entries under :data:`PREFIX` keys) with ``extras`` put back.

    Param ids are those ``form``'s groups list: local positions for an inner optimizer,
    flat indices for the consolidated dict. A nested part gets ``form``'s param groups
    (deep-copied); extra values are deep-copied.
    """
    groups = form[GROUPS]
    ids = [list(g[PARAMS]) for g in groups]
    where = {i: (g, n) for g, members in enumerate(ids) for n, i in enumerate(members)}
    kinds = dict(extras.parts)
    out: dict[Any, Any] = {}
    for key in extras.order:
        if key == STATE and extras.top:
            own = {i: _own(s) for i, s in form[STATE].items()}
            out[STATE] = {i: s for i, s in own.items() if s}
            out[STATE].update(copy.deepcopy(extras.tree[STATE]))
        elif key == GROUPS and extras.top:
            out[GROUPS] = groups
        elif kinds.get(key) == NODE:
            node = copy.deepcopy(extras.tree[key])
            node[STATE] = {**_entries(form, key), **node.get(STATE, {})}
            node[GROUPS] = copy.deepcopy(groups)
            out[key] = {k: node[k] for k in _node_order(extras.tree[key])}
        elif kinds.get(key) == PAIRS:
            out[key] = {where[i]: entry for i, entry in _entries(form, key).items()}
        else:
            out[key] = copy.deepcopy(extras.tree[key])
    return out


def _is_id(key: Any) -> bool:
    """Whether ``key`` has the type of a param id of the ``torch.optim`` format (an int)."""
    return type(key) is int


def _own(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """A param's state without the nested parts' entries."""
    return {k: v for k, v in state.items() if not (isinstance(k, str) and k.startswith(PREFIX))}


def _entries(form: Mapping[str, Any], key: Any) -> dict[Any, Any]:
    name = PREFIX + str(key)
    return {i: s[name] for i, s in form[STATE].items() if name in s}


def _node_order(rest: Mapping[Any, Any]) -> list[Any]:
    """A nested part's keys: ``state`` and ``param_groups`` first, as torch writes them."""
    return [STATE, GROUPS, *(k for k in rest if k not in (STATE, GROUPS))]


def storable(extras: Extras | None, what: str) -> Extras | None:
    """``extras`` as a file keeps them (:meth:`Extras.storable`), logging once per place
    what is left out; None for None."""
    if extras is None:
        return None
    kept, dropped = extras.storable()
    for place in dropped:
        if place not in _told:
            _told.add(place)
            logger.warning(LEFT_OUT, what, place, "has", "is")
    return kept
