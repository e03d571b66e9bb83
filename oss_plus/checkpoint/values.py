"""Type-tagged JSON encoding of Python values and the dtype strings of the format (pure).

JSON alone cannot tell a tuple from a list, an int from a float, or store inf/nan, so every
value that is not None, a bool, an int, a string or a list is wrapped in a one-key object
naming its type (``{"float": 0.9}``, ``{"tuple": [...]}``). ``docs/checkpoints.md`` lists the
tags.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

__all__ = [
    "MAX_INLINE_BYTES",
    "decode_value",
    "dtype_name",
    "dtype_string",
    "encode_value",
    "torch_dtype",
]

#: Inline tensors in param groups (e.g. a tensor ``lr``) larger than this are refused.
MAX_INLINE_BYTES = 1 << 20

#: safetensors dtype strings (the names used in file headers and in the index).
_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}
_TO_NAME = {getattr(torch, t): n for t, n in _DTYPES.items() if hasattr(torch, t)}
_TO_TORCH = {n: t for t, n in _TO_NAME.items()}


def dtype_name(dtype: torch.dtype, where: str) -> str:
    """Return the safetensors string of ``dtype`` (e.g. ``"F32"``).

    Raises:
        TypeError: safetensors cannot store ``dtype``; the message names ``where``.
    """
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise TypeError(
            f"{where} has dtype {dtype}, which safetensors cannot store (supported: "
            f"{', '.join(str(t) for t in _TO_NAME)}): convert that state to a supported dtype"
        ) from None


def dtype_string(dtype: torch.dtype) -> str:
    """Return the safetensors string of ``dtype``, or ``str(dtype)`` when it has none."""
    return _TO_NAME.get(dtype, str(dtype))


def torch_dtype(name: str, where: str) -> torch.dtype:
    """Return the torch dtype of safetensors string ``name``.

    Raises:
        ValueError: ``name`` is not a dtype string of the format.
    """
    try:
        return _TO_TORCH[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}: unknown dtype {name!r} (expected one of {sorted(_TO_TORCH)})"
        ) from None


# ----------------------------------------------------------------------------- values
def encode_value(value: Any, where: str) -> Any:
    """Encode a Python value as type-tagged JSON data (see the spec for the tags).

    Raises:
        TypeError: ``value`` (or something inside it) has a type the format cannot store.

    Example:
        >>> encode_value((0.9, 1, None, float("inf")), "betas")
        {'tuple': [{'float': 0.9}, 1, None, {'float': 'inf'}]}
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float):
        return {"float": value if math.isfinite(value) else repr(value)}
    if isinstance(value, (list, tuple)):
        items = [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        return {
            "dict": [
                [encode_value(k, f"{where} key"), encode_value(v, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    if isinstance(value, torch.Tensor):
        return {"tensor_bytes": _inline_tensor(value, where)}
    try:
        return operator.index(value)  # int and integer-like scalars (numpy ints)
    except TypeError:
        pass
    if isinstance(value, numbers.Real):  # float-like scalars (numpy floats)
        return encode_value(float(value), where)
    raise TypeError(
        f"{where} is a {type(value).__name__} ({value!r}); a checkpoint stores tensors, None, "
        "bool, int, float, str and lists/tuples/dicts of them: convert it to one of those"
    )


def _inline_tensor(value: torch.Tensor, where: str) -> dict[str, Any]:
    data = value.detach().cpu().contiguous().reshape(-1)
    nbytes = data.numel() * data.element_size()
    if nbytes > MAX_INLINE_BYTES:
        raise TypeError(
            f"{where} is a tensor of {nbytes} bytes; tensors in param groups are stored inline "
            f"in the index and are limited to {MAX_INLINE_BYTES} bytes"
        )
    return {
        "dtype": dtype_name(value.dtype, where),
        "shape": list(value.shape),
        "hex": data.view(torch.uint8).numpy().tobytes().hex(),
    }


def decode_value(data: Any, where: str) -> Any:
    """Decode what :func:`encode_value` produced.

    Raises:
        ValueError: ``data`` is not valid tagged JSON data; the message names ``where``.
    """
    if data is None or isinstance(data, (bool, int, str)):
        return data
    if isinstance(data, float):  # lenient: an untagged JSON float
        return data
    if isinstance(data, list):
        return [decode_value(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"{where}: expected a tagged value, got {data!r}")
    ((tag, body),) = data.items()
    if tag == "float" and isinstance(body, (int, float)) and not isinstance(body, bool):
        return float(body)
    if tag == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "tuple" and isinstance(body, list):
        return tuple(decode_value(v, f"{where}[{i}]") for i, v in enumerate(body))
    if (
        tag == "dict"
        and isinstance(body, list)
        and all(isinstance(kv, list) and len(kv) == 2 for kv in body)
    ):
        try:
            return {decode_value(k, where): decode_value(v, f"{where}[{k!r}]") for k, v in body}
        except TypeError:
            raise ValueError(f"{where}: a dict key is not hashable") from None
    if tag == "tensor_bytes" and isinstance(body, dict):
        dtype = torch_dtype(str(body.get("dtype")), where)
        raw = bytearray.fromhex(str(body.get("hex", "")))
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(body["shape"]).clone()
    raise ValueError(f"{where}: unknown or malformed tag {tag!r} in {data!r}")
