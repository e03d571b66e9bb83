"""Nested optimizer state <-> (tensors, JSON structure): pure functions, no I/O, no pickle.

A ``torch.optim`` state value may be a tensor, a plain value (None, bool, int, float, str)
or a list / tuple / dict of those, nested (Shampoo-style optimizers keep a list of
preconditioner tensors per parameter). :func:`flatten_value` splits such a value into the
tensors it holds, in a fixed depth-first order, and a *skeleton*: JSON data in which the
``n``-th tensor is ``{"tensor": n}``. :func:`unflatten_value` puts them back together.
Tensors can then travel as tensors (collectives, safetensors) and the skeleton as JSON text.

The skeleton uses the type tags of the checkpoint format (``docs/checkpoint_format.md``), so
JSON's blind spots do not lose information: a tuple is ``{"tuple": [...]}``, a dict is
``{"dict": [[key, value], ...]}`` (keys of any JSON-able type), a float is
``{"float": 0.9}`` (``"inf"``, ``"-inf"``, ``"nan"`` as strings); None, bools, ints, strings
and lists are themselves. Floats and ints survive exactly (``json`` writes ``repr``). A
``torch.dtype`` is ``{"dtype": "float32"}``, a ``torch.Size`` ``{"size": [2, 3]}``, and a tensor
subclass with torch's flatten protocol (torchao's low-bit optimizer states) a
``{"subclass": ...}`` node whose inner tensors are placeholders like any other
(:mod:`oss_plus.state.subclass`: only allow-listed classes are written and rebuilt).

Example:
    >>> skeleton, tensors = flatten_value({"pre": [torch.ones(2)], "k": (1, None)})
    >>> skeleton
    {'dict': [['pre', [{'tensor': 0}]], ['k', {'tuple': [1, None]}]]}
    >>> unflatten_value(skeleton, tensors)
    {'pre': [tensor([1., 1.])], 'k': (1, None)}
"""

from __future__ import annotations

import json
import math
import numbers
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from oss_plus.state.layout import VIEW_TAG, plan_spans, storage_key, view_node
from oss_plus.state.subclass import is_plain, split
from oss_plus.state.unflatten import (
    NEW_IN_5,
    SET_TAGS,
    SUBCLASS_TAG,
    TENSOR_TAG,
    OnSubclass,
    decode,
    holds_subclass,
    tags_in,
    tensor_paths,
    unflatten_state,
    unflatten_value,
)

__all__ = [
    "NEW_IN_5",
    "SET_TAGS",
    "SUBCLASS_TAG",
    "TENSOR_TAG",
    "OnSubclass",
    "decode",
    "encode",
    "encode_key",
    "flatten_state",
    "flatten_param_state",
    "flatten_value",
    "holds_subclass",
    "tags_in",
    "map_storages",
    "map_tensors",
    "tensor_paths",
    "unflatten_state",
    "unflatten_value",
]

#: Spans by storage (:func:`oss_plus.state.layout.plan_spans`).
Spans = dict[Any, tuple[int, int]]

#: Raised for a value that has no JSON form.
NOT_STORABLE = (
    "optimizer state {where} is a {kind} ({value!r}); oss_plus moves and saves tensors, None, "
    "bool, int, float, str, torch.dtype, torch.Size, lists/tuples/dicts of them and "
    "sets/frozensets of plain values: convert it to one of those"
)
#: Raised for a dict key or set item that holds a tensor or an unhashable container.
NOT_A_KEY = (
    "optimizer state {where} is a {kind} ({value!r}); oss_plus moves and saves dict keys and "
    "set items that are None, bool, int, float, str, torch.dtype or tuples/frozensets of "
    "them: use one of those"
)


def flatten_value(value: Any, where: str = "value") -> tuple[Any, list[torch.Tensor]]:
    """Split ``value`` into a JSON-able skeleton and the tensors it holds (depth first).

    Tensors are returned as they are (not copied). A tensor at top level gives
    ``({"tensor": 0}, [value])``.

    Raises:
        TypeError: something inside ``value`` is neither a tensor, a plain value nor a
            list/tuple/dict; the message names where (``where`` is the prefix).
    """
    tensors: list[torch.Tensor] = []
    return encode(value, where, _placeholder(tensors, _spans_of(value, where))), tensors


def flatten_param_state(state: Mapping[Any, Any], where: str) -> tuple[Any, list[torch.Tensor]]:
    """:func:`flatten_value` of one param's state dict, its keys' values flattened one by
    one (tensor numbers run over all of them): storage sharing is kept within the value of
    a key, as every path keeps it (:mod:`oss_plus.state.layout`).

    Example:
        >>> flatten_param_state({"m": torch.ones(1), 0: {1}}, "state[0]")[0]
        {'dict': [['m', {'tensor': 0}], [0, {'set': [1]}]]}
    """
    tensors: list[torch.Tensor] = []
    pairs = []
    for k, v in state.items():
        at = f"{where}[{k!r}]"
        key = encode_key(k, f"{where} key")
        pairs.append([key, encode(v, at, _placeholder(tensors, _spans_of(v, at)))])
    return {"dict": pairs}, tensors


def encode_key(key: Any, where: str) -> Any:
    """The tagged JSON data of a state key (:func:`encode`; a tensor inside is refused).

    Raises:
        TypeError: ``key`` holds a tensor or has no JSON form.

    Example:
        >>> encode_key((1, None), "state[0] key")
        {'tuple': [1, None]}
    """
    return encode(key, where, _tensor_key)


def _tensor_key(tensor: torch.Tensor, where: str) -> Any:
    raise TypeError(NOT_A_KEY.format(where=where, kind="Tensor", value=tensor))


def _spans_of(value: Any, where: str) -> Spans:
    """The spans the tensors of ``value`` need (:func:`oss_plus.state.layout.plan_spans`)."""
    seen: list[torch.Tensor] = []
    encode(value, where, lambda t, _: seen.append(t))
    return plan_spans(seen)


def _placeholder(tensors: list[torch.Tensor], spans: Spans) -> Callable[[torch.Tensor, str], Any]:
    """An ``on_tensor`` for :func:`encode`: append the tensor, return its placeholder; a
    tensor of ``spans`` becomes a view node over its span (appended once per storage)."""
    numbers: dict[Any, int] = {}

    def placeholder(tensor: torch.Tensor, _: str) -> Any:
        view = view_node(tensor, spans)
        if view is None:
            tensors.append(tensor)
            return {TENSOR_TAG: len(tensors) - 1}
        body, span = view
        key = storage_key(tensor) if span.numel() else ("empty", len(tensors))
        if key not in numbers:
            numbers[key] = len(tensors)
            tensors.append(span)
        return {VIEW_TAG: {"of": {TENSOR_TAG: numbers[key]}, **body}}

    return placeholder


def encode(
    value: Any,
    where: str,
    on_tensor: Callable[[torch.Tensor, str], Any],
    not_storable: str = NOT_STORABLE,
) -> Any:
    """Return the type-tagged JSON data of ``value``; each tensor becomes ``on_tensor(t, where)``.

    The one encoder of the tags: :func:`flatten_value` turns tensors into placeholders, the
    checkpoint's param groups (:mod:`oss_plus.checkpoint.values`) into inline bytes.

    Raises:
        TypeError: a value has no JSON form (``not_storable``, formatted with ``where``,
            ``kind`` and ``value``), or a dict key is a tensor or a container.
    """

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if is_plain(value):
                return on_tensor(value, where)
            return _encode_subclass(value, where, walk)
        return plain(value, where, walk)

    def key(value: Any, where: str) -> Any:
        """A dict key or set item: hashable plain values only, no tensor inside."""
        if isinstance(value, (torch.Tensor, list, dict, set)):
            kind = type(value).__name__
            raise TypeError(NOT_A_KEY.format(where=where, kind=kind, value=value))
        return plain(value, where, key)

    def plain(value: Any, where: str, inner: Callable[[Any, str], Any]) -> Any:
        """Every value but a tensor; containers hold what ``inner`` encodes."""
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.Size):
            return {"size": [int(s) for s in value]}
        if isinstance(value, float):
            return {"float": value if math.isfinite(value) else repr(value)}
        if isinstance(value, (list, tuple)):
            items = [inner(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"tuple": items}
        if isinstance(value, dict):
            pairs = [[key(k, f"{where} key"), walk(v, f"{where}[{k!r}]")] for k, v in value.items()]
            return {"dict": pairs}
        if isinstance(value, (set, frozenset)):
            items = sorted((key(v, f"{where} item") for v in value), key=_order)
            return {"frozenset" if isinstance(value, frozenset) else "set": items}
        try:
            return operator.index(value)  # int and integer-like scalars (numpy ints)
        except TypeError:
            pass
        if isinstance(value, numbers.Real):  # float-like scalars (numpy floats)
            return inner(float(value), where)
        raise TypeError(not_storable.format(where=where, kind=type(value).__name__, value=value))

    return walk(value, where)


def _order(item: Any) -> str:
    """The order of set items in a skeleton: by their JSON text (the same on every rank and
    in every run, whatever the hash seed)."""
    return json.dumps(item, sort_keys=True)


def _encode_subclass(value: torch.Tensor, where: str, walk: Callable[[Any, str], Any]) -> Any:
    """The ``{"subclass": ...}`` node of a tensor subclass (:mod:`oss_plus.state.subclass`):
    its class, inner tensors (walked: placeholders, or nested subclasses), context, size
    and stride."""
    name, inner, context = split(value, where)

    def no_tensor(tensor: torch.Tensor, at: str) -> Any:
        raise TypeError(f"optimizer state {at} is a tensor inside a tensor subclass's context")

    body = {
        "class": name,
        "tensors": [[attr, walk(t, f"{where}.{attr}")] for attr, t in inner],
        "context": encode(context, f"{where} context", no_tensor),
        "size": list(value.shape),
        "stride": list(value.stride()),
    }
    return {SUBCLASS_TAG: body}


def flatten_state(
    states: Mapping[int, Mapping[Any, Any]],
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Split per-param state (flat index -> state) into one JSON structure and its tensors.

    The structure maps ``str(index)`` to the skeleton of that param's state dict; tensor
    numbers run over all params in ascending index order. The checkpoint writer stores the
    tensors in safetensors (names from :func:`tensor_paths`) and the structure in JSON.

    Example:
        >>> structure, tensors = flatten_state({1: {"step": 3, "m": torch.zeros(2)}})
        >>> structure, len(tensors)
        ({'1': {'dict': [['step', 3], ['m', {'tensor': 0}]]}}, 1)
    """
    tensors: list[torch.Tensor] = []
    structure = {}
    for i in sorted(states):
        skeleton, mine = flatten_param_state(states[i], f"state[{i}]")
        structure[str(i)] = _renumbered(skeleton, len(tensors))
        tensors.extend(mine)
    return structure, tensors


def _renumbered(skeleton: Any, by: int) -> Any:
    """``skeleton`` with every tensor number raised by ``by``."""
    if isinstance(skeleton, list):
        return [_renumbered(v, by) for v in skeleton]
    if isinstance(skeleton, dict) and len(skeleton) == 1:
        ((tag, body),) = skeleton.items()
        if tag == TENSOR_TAG:
            return {tag: body + by}
        if tag == SUBCLASS_TAG:
            tensors = [[attr, _renumbered(v, by)] for attr, v in body["tensors"]]
            return {tag: {**body, "tensors": tensors}}
        if tag == VIEW_TAG:
            return {tag: {**body, "of": _renumbered(body["of"], by)}}
        if tag in ("tuple", "dict"):
            return {tag: _renumbered(body, by)}
    return skeleton


def map_storages(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """:func:`map_tensors`, keeping the layout (:mod:`oss_plus.state.layout`): ``fn`` maps
    the span of a view (a 1-D tensor) and every other tensor, and views are rebuilt over
    the mapped spans, so a transposed or strided view, and views of one storage, stay so
    through a copy or a move (``clone`` or ``to`` alone make strided views contiguous).

    Example:
        >>> moved = map_storages([torch.ones(2, 3).t()], lambda t: t.clone())
        >>> moved[0].stride()
        (1, 3)
    """
    try:
        skeleton, tensors = flatten_value(value)
    except TypeError:  # holds what cannot travel: mapped as it is
        return map_tensors(value, fn)
    if VIEW_TAG not in tags_in(skeleton):
        return map_tensors(value, fn)
    return unflatten_value(skeleton, [fn(t) for t in tensors])


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Return ``value`` with ``fn`` applied to every tensor inside it (containers rebuilt; a
    tensor subclass is one tensor).

    Lists, tuples and dicts are rebuilt (a new object of the same kind, a tuple for tuple
    subclasses); other values are returned as they are.

    Example:
        >>> map_tensors({"a": [torch.ones(1)], "n": 2}, lambda t: t * 3)
        {'a': [tensor([3.])], 'n': 2}
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value
