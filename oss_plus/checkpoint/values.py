"""Type-tagged JSON encoding of Python values and the dtype strings of the format (pure).

JSON alone cannot tell a tuple from a list, an int from a float, or store inf/nan, so every
value that is not None, a bool, an int, a string or a list is wrapped in a one-key object
naming its type (``{"float": 0.9}``, ``{"tuple": [...]}``). ``docs/checkpoints.md`` lists the
tags. The encoder and decoder are those of :mod:`oss_plus.state.nested` (also used for nested
optimizer state); here tensors in param groups are stored inline (``tensor_bytes``).
"""

from __future__ import annotations

from typing import Any

import torch

from oss_plus.state.nested import decode, encode

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
#: Raised for a value that has no JSON form.
NOT_STORABLE = (
    "{where} is a {kind} ({value!r}); a checkpoint stores tensors, None, bool, int, float, "
    "str, torch.dtype, torch.Size, lists/tuples/dicts of them and sets/frozensets of plain "
    "values: convert it to one of those"
)
#: Tag of a tensor stored inline (param groups only).
INLINE_TAG = "tensor_bytes"


def encode_value(value: Any, where: str) -> Any:
    """Encode a Python value as type-tagged JSON data (see the spec for the tags).

    Tensors are stored inline (:data:`INLINE_TAG`); the tags are those of
    :func:`oss_plus.state.nested.encode`.

    Raises:
        TypeError: ``value`` (or something inside it) has a type the format cannot store.

    Example:
        >>> encode_value((0.9, 1, None, float("inf")), "betas")
        {'tuple': [{'float': 0.9}, 1, None, {'float': 'inf'}]}
    """
    return encode(value, where, _inline_tensor, NOT_STORABLE)


def _inline_tensor(value: torch.Tensor, where: str) -> dict[str, Any]:
    data = value.detach().cpu().contiguous().reshape(-1)
    nbytes = data.numel() * data.element_size()
    if nbytes > MAX_INLINE_BYTES:
        raise TypeError(
            f"{where} is a tensor of {nbytes} bytes; tensors in param groups are stored inline "
            f"in the index and are limited to {MAX_INLINE_BYTES} bytes"
        )
    return {
        INLINE_TAG: {
            "dtype": dtype_name(value.dtype, where),
            "shape": list(value.shape),
            "hex": data.view(torch.uint8).numpy().tobytes().hex(),
        }
    }


def decode_value(data: Any, where: str) -> Any:
    """Decode what :func:`encode_value` produced.

    Raises:
        ValueError: ``data`` is not valid tagged JSON data; the message names ``where``.
    """
    return decode(data, where, INLINE_TAG, _decode_inline)


def _decode_inline(body: Any, where: str) -> torch.Tensor:
    if not isinstance(body, dict):
        raise ValueError(f"{where}: malformed {INLINE_TAG} {body!r}")
    dtype = torch_dtype(str(body.get("dtype")), where)
    raw = bytearray.fromhex(str(body.get("hex", "")))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(body["shape"]).clone()
