"""Skeletons back into values, and what a skeleton holds: pure functions, no I/O, no pickle.

The decoding half of :mod:`oss_plus.state.nested` (which re-exports every name here): the
tags, :func:`decode` and :func:`unflatten_value`, and the walks over a skeleton
(:func:`tensor_paths`, :func:`tags_in`).

Example:
    >>> unflatten_value({"dict": [["k", {"set": [1, 2]}], [0, {"tensor": 0}]]}, [torch.ones(1)])
    {'k': {1, 2}, 0: tensor([1.])}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from oss_plus.state.layout import VIEW_TAG, build_view, own_storage
from oss_plus.state.subclass import rebuild

__all__ = [
    "NEW_IN_5",
    "SET_TAGS",
    "SUBCLASS_TAG",
    "TENSOR_TAG",
    "OnSubclass",
    "decode",
    "holds_subclass",
    "tags_in",
    "tensor_paths",
    "unflatten_state",
    "unflatten_value",
]

#: Tag of a tensor placeholder in a skeleton: ``{"tensor": n}`` is the ``n``-th tensor.
TENSOR_TAG = "tensor"
#: Tag of a tensor subclass (:mod:`oss_plus.state.subclass`): ``{"subclass": {"class": name,
#: "tensors": [[attr, value], ...], "context": ..., "size": [...], "stride": [...]}}``.
SUBCLASS_TAG = "subclass"

#: Rebuilds a subclass node: ``(class name, inner by attr, context, size, stride, where)``.
OnSubclass = Callable[[str, dict[str, Any], Any, list[int], list[int], str], Any]

#: Tags of sets and frozensets: ``{"set": [item, ...]}`` (items in a fixed order).
SET_TAGS = ("set", "frozenset")


def unflatten_value(
    skeleton: Any,
    tensors: Sequence[Any],
    where: str = "value",
    on_subclass: OnSubclass | None = None,
) -> Any:
    """Rebuild the value :func:`flatten_value` split (tensors are used as they are).

    A subclass node is rebuilt by :func:`oss_plus.state.subclass.rebuild` (allow-listed
    classes only), or by ``on_subclass`` when given (e.g. to describe or check it).

    Raises:
        ValueError: ``skeleton`` is not valid skeleton data, names a tensor that
            ``tensors`` lacks, or a tensor subclass that is not allow-listed; the message
            names where.
    """

    spans: dict[int, Any] = {}

    def tensor_at(body: Any, where: str) -> Any:
        if not isinstance(body, int) or isinstance(body, bool):
            raise ValueError(f"{where}: malformed tensor placeholder {body!r}")
        if not 0 <= body < len(tensors):
            raise ValueError(f"{where}: tensor {body} is missing (got {len(tensors)} tensors)")
        return tensors[body]

    def view_at(body: dict[str, Any], where: str) -> Any:
        of = body["of"]
        if not (isinstance(of, dict) and set(of) == {TENSOR_TAG}):
            raise ValueError(f"{where}: a view's storage must be a tensor placeholder, got {of!r}")
        n = of[TENSOR_TAG]
        span = tensor_at(n, where)
        if not isinstance(span, torch.Tensor):  # a reference (an index's), not a tensor yet
            return span
        if n not in spans:  # the views of one span share one storage
            spans[n] = own_storage(span)
        return build_view(spans[n], body["size"], body["stride"], body["offset"], where)

    return decode(skeleton, where, TENSOR_TAG, tensor_at, on_subclass, view_at)


def decode(
    data: Any,
    where: str,
    tensor_tag: str,
    on_tensor: Callable[[Any, str], Any],
    on_subclass: OnSubclass | None = None,
    on_view: Callable[[dict[str, Any], str], Any] | None = None,
) -> Any:
    """Decode what :func:`encode` produced; ``{tensor_tag: body}`` becomes ``on_tensor(body)``,
    a subclass node ``on_subclass(...)`` (default :func:`oss_plus.state.subclass.rebuild`),
    a view node ``on_view(body)`` (checked for its structure first; without ``on_view`` a
    view node is malformed data).

    Raises:
        ValueError: ``data`` is not valid tagged JSON data; the message names ``where``.
    """

    def again(value: Any, at: str) -> Any:
        return decode(value, at, tensor_tag, on_tensor, on_subclass, on_view)

    if data is None or isinstance(data, (bool, int, str)):
        return data
    if isinstance(data, float):  # lenient: an untagged JSON float
        return data
    if isinstance(data, list):
        return [again(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"{where}: expected a tagged value, got {data!r}")
    ((tag, body),) = data.items()
    if tag == tensor_tag:
        return on_tensor(body, where)
    if tag == "float" and isinstance(body, (int, float)) and not isinstance(body, bool):
        return float(body)
    if tag == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "tuple" and isinstance(body, list):
        return tuple(again(v, f"{where}[{i}]") for i, v in enumerate(body))
    if tag == "dict" and isinstance(body, list) and all(_is_pair(kv) for kv in body):
        try:
            return {again(k, where): again(v, f"{where}[{k!r}]") for k, v in body}
        except TypeError:
            raise ValueError(f"{where}: a dict key is not hashable") from None
    if tag == "dtype" and isinstance(body, str):
        dtype = getattr(torch, body, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if tag == "size" and isinstance(body, list) and all(_is_int(s) for s in body):
        return torch.Size(body)
    if tag in SET_TAGS and isinstance(body, list):
        try:
            items = [again(v, f"{where} item") for v in body]
            return set(items) if tag == "set" else frozenset(items)
        except TypeError:
            raise ValueError(f"{where}: a set item is not hashable") from None
    if tag == VIEW_TAG and on_view is not None and _is_view_body(body):
        return on_view(body, where)
    if tag == SUBCLASS_TAG and _is_subclass_body(body):
        inner = {attr: again(v, f"{where}.{attr}") for attr, v in body["tensors"]}
        context = decode(body["context"], f"{where} context", tensor_tag, _no_tensor)
        build = on_subclass or rebuild
        return build(body["class"], inner, context, body["size"], body["stride"], where)
    raise ValueError(f"{where}: unknown or malformed tag {tag!r} in {data!r}")


def _is_pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_subclass_body(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"class", "tensors", "context", "size", "stride"}
        and isinstance(body["class"], str)
        and isinstance(body["tensors"], list)
        and all(_is_pair(kv) and isinstance(kv[0], str) for kv in body["tensors"])
        and all(
            isinstance(x, list) and all(_is_int(s) for s in x)
            for x in (body["size"], body["stride"])
        )
    )


def _is_view_body(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"of", "size", "stride", "offset"}
        and _is_int(body["offset"])
        and all(
            isinstance(x, list) and all(_is_int(s) for s in x)
            for x in (body["size"], body["stride"])
        )
        and len(body["size"]) == len(body["stride"])
    )


def _no_tensor(body: Any, where: str) -> Any:
    raise ValueError(f"{where}: a tensor subclass's context holds no tensors")


def unflatten_state(
    structure: Mapping[str, Any], tensors: Sequence[torch.Tensor]
) -> dict[int, dict[Any, Any]]:
    """Rebuild what :func:`flatten_state` split (flat index -> state).

    Raises:
        ValueError: a key of ``structure`` is not an index, or a skeleton is malformed.
    """
    states: dict[int, dict[Any, Any]] = {}
    for key, skeleton in structure.items():
        if not key.isdigit():
            raise ValueError(f"state structure: key {key!r} is not a param index")
        state = unflatten_value(skeleton, tensors, f"state[{key}]")
        if not isinstance(state, dict):
            raise ValueError(f"state[{key}]: expected a dict of state, got {type(state).__name__}")
        states[int(key)] = state
    return states


def tensor_paths(skeleton: Any, prefix: str = "") -> list[str]:
    """Return a readable path for every tensor of ``skeleton``, in tensor-number order.

    Path parts are joined with ``/`` (dict keys by their ``str``, list positions by number),
    e.g. ``"precond/0"``; usable as a safetensors name suffix.

    Example:
        >>> tensor_paths({"dict": [["pre", [{"tensor": 0}, {"tensor": 1}]]]})
        ['pre/0', 'pre/1']
    """
    found: list[tuple[int, str]] = []
    _walk_paths(skeleton, prefix, found)
    first: dict[int, str] = {}
    for number, path in found:  # the views of one span name it by the first
        first.setdefault(number, path)
    paths: list[str] = []
    for number in sorted(first):  # keys 0 and "0" of one dict: make the names unique
        path, n = first[number], 1
        while path in paths:
            path, n = f"{first[number]}#{n}", n + 1
        paths.append(path)
    return paths


def _walk_paths(skeleton: Any, path: str, found: list[tuple[int, str]]) -> None:
    def join(part: Any) -> str:
        return f"{path}/{part}" if path else str(part)

    if isinstance(skeleton, list):
        for i, item in enumerate(skeleton):
            _walk_paths(item, join(i), found)
    elif isinstance(skeleton, dict) and len(skeleton) == 1:
        ((tag, body),) = skeleton.items()
        if tag == TENSOR_TAG:
            found.append((body, path))
        elif tag == "tuple":
            _walk_paths(body, path, found)
        elif tag == VIEW_TAG and isinstance(body, dict):
            _walk_paths(body.get("of"), path, found)
        elif tag == SUBCLASS_TAG and isinstance(body, dict):
            for attr, v in body.get("tensors", ()):
                _walk_paths(v, join(attr), found)
        elif tag == "dict":
            for k, v in body:
                _walk_paths(v, join(unflatten_value(k, [])), found)


def holds_subclass(skeleton: Any) -> bool:
    """Whether ``skeleton`` (of :func:`flatten_value`) holds a tensor-subclass node.

    Example:
        >>> holds_subclass([{"tensor": 0}])
        False
    """
    return bool(tags_in(skeleton) & {SUBCLASS_TAG})


#: The tags that format version 5 added (sets, views); with a non-string key, what needs it.
NEW_IN_5 = frozenset({*SET_TAGS, VIEW_TAG})


def tags_in(skeleton: Any) -> set[str]:
    """The tags ``skeleton`` (of :func:`encode`) uses, nested ones included, and
    ``"key"`` when a dict in it has a key other than a string.

    Example:
        >>> sorted(tags_in({"dict": [[0, {"set": [1]}], ["t", {"tuple": [{"tensor": 0}]}]]}))
        ['dict', 'key', 'set', 'tensor', 'tuple']
    """
    found: set[str] = set()
    _collect_tags(skeleton, found)
    return found


def _collect_tags(skeleton: Any, found: set[str]) -> None:
    if isinstance(skeleton, list):
        for item in skeleton:
            _collect_tags(item, found)
    elif isinstance(skeleton, dict) and len(skeleton) == 1:
        ((tag, body),) = skeleton.items()
        found.add(tag)
        if tag == "dict" and isinstance(body, list):
            for pair in body:
                if isinstance(pair, list) and len(pair) == 2:
                    if not isinstance(pair[0], str):
                        found.add("key")
                    _collect_tags(pair, found)
        elif tag == SUBCLASS_TAG and isinstance(body, dict):
            _collect_tags([v for _, v in body.get("tensors", ())], found)
        elif tag in ("tuple", VIEW_TAG, *SET_TAGS):
            _collect_tags(body if tag != VIEW_TAG else body.get("of"), found)
