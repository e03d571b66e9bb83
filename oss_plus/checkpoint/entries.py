"""The per-parameter state entries of a checkpoint index: pure, no I/O, no collectives.

Each state key of a param is a :class:`TensorRef` (a tensor in a data file), a
:class:`PlainValue` (type-tagged JSON), from format version 2 a :class:`NestedValue`
(a JSON skeleton of a container whose tensors are in data files, named by
:func:`nested_names`) or, from format version 3, a :class:`PiecesValue` (a tensor shaped
like its param stored as 1-D pieces, element ranges of the flattened tensor, named by
:func:`piece_name`). ``docs/checkpoints.md`` is the specification.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oss_plus.checkpoint.fields import BAD_FIELD, need, need_int, need_ints, need_list, need_str
from oss_plus.checkpoint.values import decode_value, encode_value, torch_dtype
from oss_plus.state.nested import tensor_paths, unflatten_value

__all__ = [
    "NestedValue",
    "PiecesValue",
    "PlainValue",
    "TensorRef",
    "decode_state",
    "encode_state",
    "nested_names",
    "piece_name",
    "tensor_name",
]


def tensor_name(index: int, key: str) -> str:
    """Return the name of state tensor ``key`` of flat index ``index`` inside a file.

    A tensor inside a container value is named ``tensor_name(index, key) + "/" + path``
    (:func:`nested_names`).

    Example:
        >>> tensor_name(3, "exp_avg")
        'state.3.exp_avg'
    """
    return f"state.{index}.{key}"


def nested_names(index: int, key: str, skeleton: Any) -> list[str]:
    """Return the file names of the tensors of a container value, in tensor-number order.

    Each is ``state.<index>.<key>/<path>`` with the path of
    :func:`oss_plus.state.nested.tensor_paths` (dict keys and list positions joined by ``/``).

    Example:
        >>> nested_names(3, "pre", {"dict": [["mats", [{"tensor": 0}, {"tensor": 1}]]]})
        ['state.3.pre/mats/0', 'state.3.pre/mats/1']
    """
    return [f"{tensor_name(index, key)}/{path}" for path in tensor_paths(skeleton)]


def piece_name(index: int, key: str, start: int) -> str:
    """Return the file name of the piece starting at element ``start`` of a pieced tensor.

    Example:
        >>> piece_name(3, "exp_avg", 40)
        'state.3.exp_avg@40'
    """
    return f"{tensor_name(index, key)}@{start}"


@dataclass(frozen=True)
class TensorRef:
    """Where a state tensor lives: file, name inside it, dtype string, shape, CRC-32."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "crc32": self.crc32,
        }


@dataclass(frozen=True)
class PlainValue:
    """A non-tensor state value (int, float, bool, None, str, or containers of them)."""

    value: Any


@dataclass(frozen=True)
class NestedValue:
    """A state value holding tensors inside lists, tuples or dicts (format version 2).

    ``skeleton`` is the value as type-tagged JSON (:func:`oss_plus.state.nested.flatten_value`)
    in which ``{"tensor": n}`` stands for ``tensors[n]``. The tensors are live tensors in a
    save's entries before they are written and :class:`TensorRef` after (and in an index).
    """

    skeleton: Any
    tensors: tuple[Any, ...]


@dataclass(frozen=True)
class PiecesValue:
    """A state tensor stored as pieces: element ranges of the flattened tensor (version 3).

    The state of a param that the flat partition rule cuts across ranks: every rank holding
    a piece ``[start, end)`` of the param stores the 1-D slice of each state tensor shaped
    like the param. ``parts`` are ``(start, end, tensor)`` sorted by ``start``: live 1-D
    tensors in a save's entries before they are written, :class:`TensorRef` after (and in
    an index). In an index the parts cover ``0 .. numel(shape)`` exactly
    (:func:`check_pieces`); while a rank saves, its entries hold its own part only.

    Attributes:
        shape: the shape of the whole (stitched) tensor: the param's.
        parts: ``(start, end, tensor or TensorRef)`` per piece.
    """

    shape: tuple[int, ...]
    parts: tuple[tuple[int, int, Any], ...]

    @property
    def numel(self) -> int:
        """The element count of the whole tensor."""
        return math.prod(self.shape)

    def merged(self, other: PiecesValue) -> PiecesValue:
        """Return the pieces of both (sorted by start), with this one's shape."""
        return PiecesValue(self.shape, tuple(sorted(self.parts + other.parts, key=_start)))


def _start(part: tuple[int, int, Any]) -> int:
    return part[0]


def check_pieces(value: PiecesValue, where: str) -> None:
    """Check that ``value``'s parts (TensorRefs) cover its tensor exactly, in order.

    Every part must be a 1-D tensor of ``end - start`` elements of one dtype, starting where
    the previous one ended, the first at 0 and the last ending at ``numel(shape)``.

    Raises:
        ValueError: a missing, overlapping or misshaped piece, naming ``where`` and the ranges.
    """
    ranges = [(a, b) for a, b, _ in value.parts]
    at, problem = 0, ""
    for a, b, ref in value.parts:
        if a != at or b <= a:
            problem = f"a piece [{a}, {b}) where element {at} was expected"
        elif tuple(ref.shape) != (b - a,):
            problem = f"the piece [{a}, {b}) is stored with shape {tuple(ref.shape)}"
        elif ref.dtype != value.parts[0][2].dtype:
            problem = f"the piece [{a}, {b}) is {ref.dtype}, the first {value.parts[0][2].dtype}"
        if problem:
            break
        at = b
    if not problem and at != value.numel:
        problem = f"the pieces end at element {at}"
    if problem:
        raise ValueError(
            f"{where}: the pieces {ranges} do not make the tensor of shape {value.shape} "
            f"({value.numel} elements): {problem}; a piece is missing or the index is damaged: "
            "restore the checkpoint or re-save it"
        )


def encode_state(
    state: Mapping[int, Mapping[Any, TensorRef | PlainValue | NestedValue | PiecesValue]],
) -> dict[str, Any]:
    """Encode per-param state entries (``TensorRef``, ``PlainValue``, ``NestedValue``).

    Raises:
        TypeError: a plain value cannot be stored.
    """
    return {str(i): _encode_entries(state[i], i) for i in sorted(state)}


def _encode_entries(entries: Mapping[Any, Any], i: int) -> dict[str, Any]:
    """The JSON object of one param's entries. A key that is not a string (heavyball nests
    each param's state under ``0``; format version 5) is written under a label, ``#`` and
    its tagged JSON text (``#0``, ``#{"tuple": [1, 2]}``; ``~`` appended until unique), with
    the key itself, tagged, as the entry's ``"key"``."""
    out: dict[str, Any] = {}
    strings = {k for k in entries if isinstance(k, str)}
    for key, entry in entries.items():
        encoded = _encode_entry(entry, i, key)
        if isinstance(key, str):
            out[key] = encoded
            continue
        tagged = encode_value(key, f"state {i} key {key!r}")
        label = "#" + json.dumps(tagged, separators=(",", ":"))
        while label in strings or label in out:
            label += "~"
        out[label] = {**encoded, "key": tagged}
    return out


def _encode_entry(
    entry: TensorRef | PlainValue | NestedValue | PiecesValue, i: int, key: Any
) -> dict[str, Any]:
    if isinstance(entry, TensorRef):
        return {"tensor": entry.to_json()}
    if isinstance(entry, PiecesValue):
        parts = [{"start": a, "end": b, "tensor": ref.to_json()} for a, b, ref in entry.parts]
        return {"pieces": parts, "shape": list(entry.shape)}
    if isinstance(entry, NestedValue):
        return {"nested": entry.skeleton, "tensors": [ref.to_json() for ref in entry.tensors]}
    return {"value": encode_value(entry.value, f"state {i} key {key!r}")}


def decode_state(
    data: Mapping[str, Any], where: str, files: Mapping[str, Any]
) -> dict[int, dict[Any, TensorRef | PlainValue | NestedValue | PiecesValue]]:
    """Decode what :func:`encode_state` produced; every file must be one of ``files``.

    The pieces of a :class:`PiecesValue` are sorted by start but not checked for coverage
    (the metadata of one rank holds its own piece only): :func:`check_pieces` does that.
    Each tensor's recorded name must be the one its flat index and key give
    (:func:`tensor_name`, :func:`piece_name`, :func:`nested_names`, with ``~`` appended
    when a name was taken), so a renamed key cannot claim another key's tensor.

    Raises:
        ValueError: a malformed entry or a missing field (named by index, key and field),
            an unlisted file, or a tensor stored under another key's name.
    """
    if not isinstance(data, dict):
        raise ValueError(BAD_FIELD.format(where=where, problem="'state' is not a JSON object"))
    decoded: dict[int, dict[Any, TensorRef | PlainValue | NestedValue | PiecesValue]] = {}
    for i, entries in data.items():
        if not str(i).isdigit() or not isinstance(entries, dict):
            problem = f"state entry {i!r} is not a flat index mapped to an object of keys"
            raise ValueError(BAD_FIELD.format(where=where, problem=problem))
        decoded[int(i)] = _parse_entries(entries, f"{where}: state {i}", files, int(i))
    return decoded


def _parse_entries(
    entries: Mapping[str, Any], where: str, files: Mapping[str, Any], i: int
) -> dict[Any, Any]:
    """One param's entries by key: a label's ``"key"`` member is the key (version 5)."""
    out: dict[Any, Any] = {}
    for label, entry in entries.items():
        if not isinstance(entry, dict):
            problem = f"key {label!r}: the entry is not an object"
            raise ValueError(BAD_FIELD.format(where=where, problem=problem))
        key = decode_value(entry["key"], f"{where} key {label!r}") if "key" in entry else label
        try:
            if key in out:
                raise ValueError(f"{where}: key {key!r} is listed twice")
        except TypeError:
            raise ValueError(f"{where}: key {label!r} is not hashable") from None
        out[key] = _parse_entry(entry, f"{where} key {key!r}", files, i, key)
    return out


def _parse_entry(
    entry: Any, where: str, files: Mapping[str, Any], i: int, key: Any
) -> TensorRef | PlainValue | NestedValue | PiecesValue:
    if not isinstance(entry, dict):
        raise ValueError(BAD_FIELD.format(where=where, problem="the entry is not an object"))
    if "value" in entry:
        return PlainValue(decode_value(entry["value"], where))
    if "pieces" in entry:
        parts = []
        for n, p in enumerate(need_list(entry, "pieces", where)):
            at = f"{where} piece {n}"
            start = need_int(p, "start", at)
            ref = _parse_ref(need(p, "tensor", at), at, files, piece_name(i, key, start))
            parts.append((start, need_int(p, "end", at), ref))
        shape = tuple(need_ints(entry, "shape", where))
        return PiecesValue(shape, tuple(sorted(parts, key=_start)))
    if "nested" in entry:
        skeleton = entry["nested"]
        names = nested_names(i, key, skeleton)
        tensors = need_list(entry, "tensors", where)
        if len(names) != len(tensors):
            problem = f"{len(names)} tensor placeholders for {len(tensors)} tensors"
            raise ValueError(BAD_FIELD.format(where=where, problem=problem))
        refs = tuple(
            _parse_ref(ref, f"{where} tensor {n}", files, names[n]) for n, ref in enumerate(tensors)
        )
        # raises ValueError if malformed; a subclass is rebuilt (allow-list) only when loaded
        unflatten_value(skeleton, refs, where, on_subclass=_structure_only)
        return NestedValue(skeleton, refs)
    if "tensor" not in entry:
        problem = "the entry has none of the fields 'tensor', 'value', 'nested', 'pieces'"
        raise ValueError(BAD_FIELD.format(where=where, problem=problem))
    return _parse_ref(entry["tensor"], where, files, tensor_name(i, key))


def _structure_only(*_: Any) -> None:
    """A subclass node, checked for its structure only (see ``unflatten_value``)."""


def _parse_ref(ref: Any, where: str, files: Mapping[str, Any], expected: str) -> TensorRef:
    parsed = TensorRef(
        need_str(ref, "file", where),
        need_str(ref, "name", where),
        need_str(ref, "dtype", where),
        tuple(need_ints(ref, "shape", where)),
        need_int(ref, "crc32", where),
    )
    torch_dtype(parsed.dtype, where)
    if parsed.file not in files:
        raise ValueError(f"{where}: refers to file {parsed.file!r}, which the index does not list")
    suffix = parsed.name[len(expected) :]
    if not parsed.name.startswith(expected) or suffix.strip("~"):
        raise ValueError(
            f"{where}: names the stored tensor {parsed.name!r}, but this entry's tensor is "
            f"stored as {expected!r}: the key or the name was changed; restore the index "
            "from a backup or re-save the checkpoint"
        )
    return parsed
