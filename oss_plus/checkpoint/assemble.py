"""Reading the stored state a rank asks for, and assembling its values from the tensors.

:func:`read_states` plans, per (param, key), the reads that make a value: a stored tensor
whole, the pieces of one stitched (``partition_rule="flat"`` saves), or only the elements
of this rank's piece. Each data file is opened once (``safe_open``, lazily: only the
tensors asked for are read), checked to belong to the index's save, and every tensor is
checked against the index (name, dtype, shape and, when read whole, its CRC-32). No
pickle: nested values are rebuilt from their JSON skeleton. Validating the index and the
files first is :mod:`oss_plus.checkpoint.validate`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from oss_plus.checkpoint.format import (
    INDEX_FILE,
    SAVE_ID_KEY,
    Index,
    NestedValue,
    PiecesValue,
    TensorRef,
)
from oss_plus.checkpoint.plan import nbytes_of
from oss_plus.checkpoint.storage import crc32_of
from oss_plus.checkpoint.values import dtype_name
from oss_plus.state.nested import unflatten_value
from oss_plus.state.subclass import is_plain

__all__ = ["OTHER_SAVE", "PARTIAL_READ_BYTES", "read_states"]

#: Message when the data files of a directory come from two different saves.
OTHER_SAVE = (
    "{file}: this file belongs to save {found!r} but {index} is from save {expected!r}: the "
    "directory mixes files of two saves; restore the matching file or re-save the checkpoint"
)

#: A stored tensor of which a rank needs only some elements (a piece, under the flat rule)
#: is read whole, and checksummed, up to this many bytes; a larger one is read in part
#: (``get_slice``: only the rows that hold the elements), which checks its dtype and shape
#: but cannot check its CRC-32.
PARTIAL_READ_BYTES = 16 << 20
#: Elements ``[lo, hi)`` of a stored tensor, flattened: what one read returns.
_Request = tuple[TensorRef, int, int]


def read_states(
    path: Path,
    index: Index,
    indices: Iterable[int],
    pieces: Mapping[int, tuple[int, int]] | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
) -> dict[int, dict[str, Any]]:
    """Read the state of the params ``indices`` only (lazy per-tensor reads, checksummed).

    A param of ``pieces`` (flat index -> ``(start, end)``) is wanted as this rank's piece:
    every state tensor shaped like the param (``shapes[i]``; stored whole or as pieces)
    comes back as the 1-D slice of elements ``[start, end)``, read from the stored tensors
    that overlap it, and every other value as it is. Any other param comes back whole, a
    tensor stored as pieces stitched. A stored tensor read whole is checksummed; one read
    in part (larger than :data:`PARTIAL_READ_BYTES`) is checked for dtype and shape only.

    Raises:
        ValueError: a file is unreadable, from another save, or a tensor differs from the
            index (dtype, shape, checksum). The message names the file and the tensor.
    """
    wanted = sorted(i for i in set(indices) if i in index.state)
    plans, by_file = _plan_reads(index, wanted, pieces or {}, shapes)
    got: dict[tuple[str, str, int, int], torch.Tensor] = {}
    with torch.profiler.record_function("oss_plus::checkpoint_read"):
        for name, listed in by_file.items():
            got.update(_read_file(path / name, listed, index.save_id, path / INDEX_FILE))

    def value_of(i: int, key: str, entry: Any) -> Any:
        if (i, key) in plans:
            requests, shape = plans[(i, key)]
            parts = [got[(r.file, r.name, lo, hi)] for r, lo, hi in requests]
            return parts[0].reshape(shape) if len(parts) == 1 else torch.cat(parts).view(shape)
        if isinstance(entry, NestedValue):
            tensors = [_whole(got, r) for r in entry.tensors]
            value = unflatten_value(entry.skeleton, tensors, f"state[{i}][{key!r}]")
            piece = (pieces or {}).get(i)
            if piece is not None and _param_shaped(value, shapes, i):  # a view, as a piece
                return value.reshape(-1)[piece[0] : piece[1]].clone()
            return value
        return copy.deepcopy(entry.value)

    return {i: {k: value_of(i, k, v) for k, v in index.state[i].items()} for i in wanted}


def _param_shaped(value: Any, shapes: Sequence[Sequence[int]] | None, i: int) -> bool:
    """Whether ``value`` is a plain tensor shaped like param ``i`` (a per-element tensor
    stored as a view, version 5: wanted as this rank's piece like a stored one)."""
    return (
        shapes is not None
        and isinstance(value, torch.Tensor)
        and is_plain(value)
        and tuple(value.shape) == tuple(shapes[i])
    )


def _plan_reads(
    index: Index,
    wanted: Sequence[int],
    pieces: Mapping[int, tuple[int, int]],
    shapes: Sequence[Sequence[int]] | None,
) -> tuple[
    dict[tuple[int, str], tuple[list[_Request], tuple[int, ...]]], dict[str, list[_Request]]
]:
    """Per (flat index, key) the reads that make its tensor and the tensor's shape; and
    every read (tensors inside nested values too) by file."""
    plans: dict[tuple[int, str], tuple[list[_Request], tuple[int, ...]]] = {}
    nested: list[_Request] = []
    for i in wanted:
        shape = tuple(shapes[i]) if shapes is not None else None
        for key, entry in index.state[i].items():
            if isinstance(entry, NestedValue):
                nested.extend((ref, 0, _numel(ref.shape)) for ref in entry.tensors)
            planned = _requests(entry, pieces.get(i), shape)
            if planned is not None:
                plans[(i, key)] = planned
    by_file: dict[str, list[_Request]] = {}
    for request in [r for requests, _ in plans.values() for r in requests] + nested:
        by_file.setdefault(request[0].file, []).append(request)
    return plans, by_file


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _whole(got: Mapping[tuple[str, str, int, int], torch.Tensor], ref: TensorRef) -> torch.Tensor:
    return got[(ref.file, ref.name, 0, _numel(ref.shape))]


def _requests(
    entry: Any, piece: tuple[int, int] | None, shape: tuple[int, ...] | None
) -> tuple[list[_Request], tuple[int, ...]] | None:
    """The reads that make one state value, and the shape of the result (None: a plain
    value, or a :class:`NestedValue`, whose tensors are read whole)."""
    if isinstance(entry, TensorRef):
        if piece is not None and entry.shape == shape:
            return [(entry, *piece)], (piece[1] - piece[0],)
        return [(entry, 0, _numel(entry.shape))], entry.shape
    if not isinstance(entry, PiecesValue):
        return None
    if piece is None:
        return [(ref, 0, b - a) for a, b, ref in entry.parts], entry.shape
    start, end = piece
    requests = [
        (ref, max(start, a) - a, min(end, b) - a)
        for a, b, ref in entry.parts
        if a < end and start < b
    ]
    return requests, (end - start,)


def _read_file(
    file: Path, requests: list[_Request], save_id: str, index_file: Path
) -> dict[tuple[str, str, int, int], torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            found = (handle.metadata() or {}).get(SAVE_ID_KEY)
            if found != save_id:
                raise ValueError(
                    OTHER_SAVE.format(file=file, found=found, index=index_file, expected=save_id)
                )
            return {
                (ref.file, ref.name, lo, hi): _read_range(handle, file, ref, lo, hi)
                for ref, lo, hi in requests
            }
    except SafetensorError as exc:
        raise ValueError(
            f"{file}: not a readable safetensors file ({exc}): the file is truncated or corrupted; "
            "restore it or re-save the checkpoint"
        ) from None


def _read_range(handle: Any, file: Path, ref: TensorRef, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a stored tensor (all of them: the tensor as stored), flattened."""
    numel = _numel(ref.shape)
    if (lo, hi) == (0, numel):
        return _read_tensor(handle, file, ref)
    if nbytes_of(ref.dtype, ref.shape) <= PARTIAL_READ_BYTES:
        return _read_tensor(handle, file, ref).reshape(-1)[lo:hi].clone()
    _check_name(handle, file, ref)
    stored = handle.get_slice(ref.name)
    _check_header(file, ref, stored.get_dtype(), tuple(stored.get_shape()))
    row = numel // ref.shape[0]
    first = lo // row
    rows = stored[first : -(-hi // row)].reshape(-1)
    return rows[lo - first * row : hi - first * row].clone()


def _check_name(handle: Any, file: Path, ref: TensorRef) -> None:
    if ref.name not in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
        raise ValueError(
            f"{file}: no tensor {ref.name!r}, which the index places in this file: the file does "
            "not match its index; restore it or re-save the checkpoint"
        )


def _check_header(file: Path, ref: TensorRef, dtype: str, shape: tuple[int, ...]) -> None:
    if dtype != ref.dtype or shape != ref.shape:
        raise ValueError(
            f"{file}: tensor {ref.name!r} is {dtype} {shape} but the index records "
            f"{ref.dtype} {ref.shape}: the file does not match its index; restore it or "
            "re-save the checkpoint"
        )


def _read_tensor(handle: Any, file: Path, ref: TensorRef) -> torch.Tensor:
    _check_name(handle, file, ref)
    tensor = handle.get_tensor(ref.name)
    _check_header(file, ref, dtype_name(tensor.dtype, ref.name), tuple(tensor.shape))
    crc = crc32_of(tensor)
    if crc != ref.crc32:
        raise ValueError(
            f"{file}: tensor {ref.name!r} has checksum {crc:#010x} but the index records "
            f"{ref.crc32:#010x}: the file is corrupted; restore it or re-save the checkpoint"
        )
    return tensor
