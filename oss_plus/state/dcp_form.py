"""The form in which a state value DCP cannot carry is handed to torch's DCP: pure, no I/O.

torch's state-dict API carries tensors, ints, floats, strings, None and dicts, lists and
tuples of them (with ``flatten_optimizer_state_dict=True``: tensors, ints, floats and
dicts with string keys only). Anything else a plain optimizer's state holds travels as a
dict of plain tensors by path plus a JSON description (:mod:`oss_plus.state.nested`):

* a tensor subclass alone (torchao's low-bit states): its inner tensors by path and under
  :data:`SUBCLASS_KEY` its skeleton, as the UTF-8 bytes of a uint8 tensor (the form of
  format 4; kept as it is so earlier DCP checkpoints load);
* any other value DCP cannot carry -- a set or frozenset (heavyball's ``is_initialized``),
  a key that is not a string (heavyball nests each param's state under ``0``; the entry is
  then named ``str(key)``, as torch's flattened form names it, or ``#`` + the key's tagged
  JSON where another key has that name), a ``torch.dtype``, a list under
  ``flatten_optimizer_state_dict`` (SOAP's eigenbases), a tuple under ``full_state_dict``
  (torch's full load would make it a list): its tensors by path (a view as its
  span, :mod:`oss_plus.state.layout`) and under :data:`VALUE_KEY` the key and skeleton as
  JSON with the CRC-32 of its own text (``crc32``, checked before anything in it is used: a
  damaged description is refused, naming the param and key), held as a Python int (its
  bytes, big-endian, after a 1 byte), which DCP saves as a plain value and hands back
  whole whatever the loading template held (a uint8 tensor would have to keep its length:
  a set that grew would not load).

DCP writes tensor values into the tensors of the loading optimizer's own state (torch's
template, made by a step at lr 0), so a tensor that DCP carries natively keeps the layout
the loading optimizer gives it; inside the form a view keeps the saved layout.

Example:
    >>> form = to_dcp_form({0: {"done": {1}}, "m": torch.ones(1)}, "state[0]")
    >>> sorted(form), from_dcp_form(form, "state[0]")
    (['0', 'm'], {0: {'done': {1}}, 'm': tensor([1.])})
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from oss_plus.state.nested import (
    encode_key,
    flatten_value,
    holds_subclass,
    tensor_paths,
    unflatten_value,
)
from oss_plus.state.subclass import is_plain

__all__ = [
    "EXTRAS_KEY",
    "SUBCLASS_KEY",
    "VALUE_KEY",
    "dcp_native",
    "extras_from_number",
    "extras_to_number",
    "from_dcp_form",
    "to_dcp_form",
]

#: The key of a tensor subclass's JSON description (class, context, shape) in its DCP form.
SUBCLASS_KEY = "oss_plus_subclass"
#: The key of the description (``{"key": ..., "skeleton": ...}``, an int) of any other form.
VALUE_KEY = "oss_plus_value"
#: The key, in the first param group handed to DCP, of the inner optimizer's extras
#: (:mod:`oss_plus.state.extras`), an int like :data:`VALUE_KEY`'s description.
EXTRAS_KEY = "oss_plus_extras"


def dcp_native(value: Any, flat: bool = False, full: bool = False) -> bool:
    """Whether torch's state-dict API carries ``value`` as it is: never None (a DCP save
    drops it: pytorch_optimizer's StableAdamW keeps ``kahan_comp=None``); under
    ``flatten_optimizer_state_dict=True`` (``flat``) no list, tuple or string; under
    ``full_state_dict=True`` (``full``) no tuple (torch's full load makes it a list); under
    either no empty container (SOAP's ``[[]]`` for a bias: torch keeps leaves only).

    Example:
        >>> dcp_native([torch.ones(1), 2]), dcp_native(None), dcp_native([torch.ones(1)], flat=True)
        (True, False, False)
    """
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return is_plain(value)
    if isinstance(value, (bool, int, float)):
        return True
    if (flat or full) and isinstance(value, (dict, list, tuple)) and not value:
        return False  # torch's flattening keeps leaves only: an empty container is lost
    if isinstance(value, dict):
        return all(isinstance(k, str) and dcp_native(v, flat, full) for k, v in value.items())
    if flat:
        return False
    if isinstance(value, str):
        return True
    kinds = (list,) if full else (list, tuple)
    return type(value) in kinds and all(dcp_native(v, flat, full) for v in value)


def to_dcp_form(
    state: Mapping[Any, Any], where: str, flat: bool = False, full: bool = False
) -> dict[str, Any]:
    """``state`` with every value DCP cannot carry in its form (see the module docstring);
    tensors are live, not copied. ``flat`` and ``full``: the options of :func:`dcp_native`
    (the same at the save and at the load, as DCP needs).

    Raises:
        TypeError: a value that cannot travel (a subclass not allow-listed, an object).

    Example:
        >>> to_dcp_form({"step": 1, "m": torch.ones(1)}, "state[0]")
        {'step': 1, 'm': tensor([1.])}
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        at = f"{where}[{key!r}]"
        if isinstance(key, str) and isinstance(value, torch.Tensor) and not is_plain(value):
            skeleton, tensors = flatten_value(value, at)
            text = torch.frombuffer(bytearray(json.dumps(skeleton).encode()), dtype=torch.uint8)
            out[key] = {SUBCLASS_KEY: text, **dict(zip(tensor_paths(skeleton), tensors))}
        elif isinstance(key, str) and dcp_native(value, flat, full):
            out[key] = value
        else:
            tagged = encode_key(key, f"{where} key")
            skeleton, tensors = flatten_value(value, at)
            scalars = _scalars(tensors)
            described = {"key": tagged, "skeleton": skeleton, "scalars": scalars}
            described["crc32"] = zlib.crc32(json.dumps(described).encode())
            raw = json.dumps(described).encode()
            paths = tensor_paths(skeleton)
            out[_name(key, tagged, state, out)] = {
                VALUE_KEY: int.from_bytes(b"\x01" + raw, "big"),
                **{p: t for n, (p, t) in enumerate(zip(paths, tensors)) if str(n) not in scalars},
            }
    return out


def _scalars(tensors: list[torch.Tensor]) -> dict[str, list[Any]]:
    """The 0-dim tensors of a form, by number: ``[dtype, value]``. They travel in its
    description (a value torch sets whole), not as tensors: a template made at another world
    size may hold them elsewhere (heavyball keeps ``step`` on each instance's first param)."""
    out = {}
    for n, t in enumerate(tensors):
        if t.dim() == 0 and not t.dtype.is_complex:
            item = t.item()
            value = (
                {"float": item if math.isfinite(item) else repr(item)}
                if isinstance(item, float)
                else item
            )
            out[str(n)] = [str(t.dtype).removeprefix("torch."), value]
    return out


def _name(key: Any, tagged: Any, state: Mapping[Any, Any], out: Mapping[str, Any]) -> str:
    """The entry name of ``key``: itself, or ``str(key)`` (what torch's flattened form names
    a key, and finds again by the live state's keys), unless another key is named so; then
    ``#`` and its tagged JSON, with ``~`` appended until unique."""
    if isinstance(key, str):
        return key
    name = str(key)
    taken = {k for k in state if isinstance(k, str)} | set(out)
    if name in taken or sum(str(k) == name for k in state) > 1:
        name = "#" + json.dumps(tagged)
        while name in taken:
            name += "~"
    return name


def from_dcp_form(state: Mapping[str, Any], where: str) -> dict[Any, Any]:
    """``state`` with every DCP form of :func:`to_dcp_form` rebuilt.

    Raises:
        ValueError: a malformed form, a missing inner tensor, or a class that is not
            allow-listed (named).
    """
    out: dict[Any, Any] = {}
    for key, value in state.items():
        at = f"{where}[{key!r}]"
        if isinstance(value, Mapping) and SUBCLASS_KEY in value:
            out[key] = _rebuild(_subclass_skeleton(value[SUBCLASS_KEY], at), value, at)
        elif isinstance(value, Mapping) and VALUE_KEY in value:
            described = _description(value[VALUE_KEY], at)
            key = unflatten_value(described["key"], [], at)
            out[key] = _rebuild(described["skeleton"], value, at, described.get("scalars", {}))
        else:
            out[key] = value
    return out


def _subclass_skeleton(text: Any, where: str) -> Any:
    if isinstance(text, torch.Tensor):
        text = bytes(text.detach().cpu().numpy()).decode()
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: a malformed tensor-subclass description: the DCP checkpoint is damaged; "
            "restore it from a backup or re-save it"
        ) from None


def _description(number: Any, where: str) -> dict[str, Any]:
    try:
        raw = int(number).to_bytes((int(number).bit_length() + 7) // 8, "big")
        described = json.loads(raw[1:].decode()) if raw[:1] == b"\x01" else None
    except (TypeError, ValueError, OverflowError):
        described = None
    if not isinstance(described, dict) or not {"key", "skeleton", "crc32"} <= set(described):
        raise ValueError(
            f"{where}: a malformed {VALUE_KEY} description of a state value: the DCP "
            "checkpoint is damaged; restore it from a backup or re-save it"
        )
    crc = described.pop("crc32")
    if crc != zlib.crc32(json.dumps(described).encode()):
        raise ValueError(
            f"{where}: the {VALUE_KEY} description of a state value fails its CRC-32: the DCP "
            "checkpoint is damaged; restore it from a backup or re-save it"
        )
    return described


def _rebuild(
    skeleton: Any, value: Mapping[str, Any], where: str, scalars: Mapping[str, Any] | None = None
) -> Any:
    scalars = scalars or {}
    paths = tensor_paths(skeleton)
    missing = [p for n, p in enumerate(paths) if p not in value and str(n) not in scalars]
    if missing:
        what = (
            "tensor subclass's inner tensors"
            if not scalars and holds_subclass(skeleton)
            else "state value's tensors"
        )
        raise ValueError(
            f"{where}: the {what} {missing} are missing: the DCP checkpoint is damaged or was "
            "saved without them; restore it or re-save it"
        )
    tensors = [
        _scalar(scalars[str(n)], where) if str(n) in scalars else value[p]
        for n, p in enumerate(paths)
    ]
    return unflatten_value(skeleton, tensors, where)


def _scalar(spec: Any, where: str) -> torch.Tensor:
    dtype = (
        getattr(torch, str(spec[0]), None) if isinstance(spec, list) and len(spec) == 2 else None
    )
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: a malformed 0-dim tensor {spec!r}")
    number = spec[1]["float"] if isinstance(spec[1], dict) else spec[1]
    return torch.tensor(float(number) if isinstance(number, str) else number, dtype=dtype)


def extras_to_number(value: Any, where: str) -> int:
    """``value`` (an :class:`~oss_plus.state.extras.Extras`' plain value) as one int that DCP
    saves and sets whole: its skeleton and its tensors (inline: dtype, shape, bytes) as JSON
    with the CRC-32 of its own text, as :data:`VALUE_KEY`'s description.

    Raises:
        TypeError: a value that cannot travel.

    Example:
        >>> extras_from_number(extras_to_number({"n": torch.ones(2)}, "x"), "x")
        {'n': tensor([1., 1.])}
    """
    skeleton, tensors = flatten_value(value, where)
    inline = [[str(t.dtype).removeprefix("torch."), list(t.shape), _hex(t)] for t in tensors]
    described: dict[str, Any] = {"key": "extras", "skeleton": skeleton, "tensors": inline}
    described["crc32"] = zlib.crc32(json.dumps(described).encode())
    return int.from_bytes(b"\x01" + json.dumps(described).encode(), "big")


def _hex(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return data.view(torch.uint8).numpy().tobytes().hex()


def extras_from_number(number: Any, where: str) -> Any:
    """The value :func:`extras_to_number` encoded.

    Raises:
        ValueError: a damaged description (its CRC-32), naming ``where``.
    """
    described = _description(number, where)
    try:
        tensors = []
        for dtype, shape, text in described["tensors"]:
            raw = torch.frombuffer(bytearray.fromhex(text), dtype=torch.uint8)
            tensors.append(raw.view(getattr(torch, dtype)).reshape(shape).clone())
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where}: malformed optimizer extras ({exc})") from None
    return unflatten_value(described["skeleton"], tensors, where)
