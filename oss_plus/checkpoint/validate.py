"""Checking a checkpoint before any tensor is read: its index, its files, its fit.

:func:`read_index` parses and validates ``index.json`` (no pickle: JSON with no
non-standard constants); :func:`check_files` checks that every data file the index lists
exists with its recorded size; :func:`check_fits` checks the index against the params of
the optimizer being loaded (groups, shapes, dtypes, and the state tensors as an in-memory
``load_state_dict`` checks them). Every error names the file and the fix. Reading the
tensors themselves is :mod:`oss_plus.checkpoint.assemble`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from oss_plus.checkpoint.format import (
    INDEX_FILE,
    SEALED_VERSION,
    Index,
    NestedValue,
    PiecesValue,
    TensorRef,
)
from oss_plus.checkpoint.seal import CHECKSUM_KEY, DAMAGED_INDEX, check_seal
from oss_plus.checkpoint.values import dtype_string
from oss_plus.state.index import state_shape_error

__all__ = ["check_claims", "check_files", "check_fits", "read_index"]


#: The fix of a damaged index.
_DAMAGED_FIX = "the index is damaged; restore it from a backup or re-save the checkpoint"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def read_index(path: Path) -> Index:
    """Read ``path/index.json``, check its checksum, then parse and validate it.

    The checksum (format version 5, :mod:`oss_plus.checkpoint.seal`) is checked on the raw
    text before anything is parsed; an index of versions 1-4 carries none and is parsed as
    before. An index that claims version 5 (or newer) without a checksum is refused.

    Raises:
        FileNotFoundError: no directory or no index at ``path``.
        NotADirectoryError: ``path`` is a file.
        ValueError: the index's checksum does not match, or it is not valid JSON, not an
            oss_plus index, of another version, or misses a required field (named).
    """
    file = path / INDEX_FILE
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"{path} is a file, not a checkpoint directory: pass the directory that "
            f"save_checkpoint() wrote (the one holding {INDEX_FILE})"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist")
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} holds no {INDEX_FILE}: it is not an oss_plus checkpoint, or its first save "
            "did not complete"
        )
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not UTF-8 ({exc}): {_DAMAGED_FIX}") from None
    crc = check_seal(text, str(file))
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc}): {_DAMAGED_FIX}") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if crc is None and isinstance(version, int) and version >= SEALED_VERSION:
        problem = f"format version {version} without its {CHECKSUM_KEY!r}"
        raise ValueError(DAMAGED_INDEX.format(where=file, problem=problem))
    return replace(Index.from_json(data, str(file)), index_crc32=crc)


def check_files(path: Path, index: Index) -> None:
    """Check that every data file of ``index`` exists with its recorded size.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file has another size.
    """
    for name, info in index.files.items():
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{file} is missing (the shard written by rank {info['rank']}): the checkpoint "
                "is incomplete; restore the file or re-save the checkpoint"
            ) from None
        if size != info["bytes"]:
            raise ValueError(
                f"{file} has {size} bytes but {INDEX_FILE} records {info['bytes']}: the file is "
                "truncated or was replaced; restore it or re-save the checkpoint"
            )
    check_claims(path, index)


def check_claims(path: Path, index: Index) -> None:
    """Check that the tensors each data file holds are exactly those the index places in it.

    Reads each file's safetensors header only. A stored tensor that no entry of the index
    claims means an entry was lost (its param would silently restart from empty state); a
    claimed tensor that is not there means the file does not match its index.

    Raises:
        ValueError: an unreadable header, an unclaimed or a missing tensor (named).
    """
    claimed: dict[str, set[str]] = {name: set() for name in index.files}
    owner: dict[tuple[str, str], str] = {}
    for i, entries in index.state.items():
        for key, entry in entries.items():
            for ref in _refs(entry):
                claimed[ref.file].add(ref.name)
                owner[(ref.file, ref.name)] = f"state {i} key {key!r}"
    for name, names in claimed.items():
        file = path / name
        stored = set(_stored_names(file))
        extra, missing = sorted(stored - names), sorted(names - stored)
        if missing:
            raise ValueError(
                f"{file}: no tensor {missing[0]!r}, which {path / INDEX_FILE} places in this "
                f"file for {owner[(name, missing[0])]}: the file does not match its index; "
                "restore it or re-save the checkpoint"
            )
        if extra:
            raise ValueError(
                f"{file} holds the tensor {extra[0]!r} ({len(extra)} in all), which no entry "
                f"of {path / INDEX_FILE} claims: the index lost the state entry of that "
                "tensor (it would load as empty state); restore the index from a backup or "
                "re-save the checkpoint"
            )


def _refs(entry: Any) -> list[TensorRef]:
    if isinstance(entry, TensorRef):
        return [entry]
    if isinstance(entry, PiecesValue):
        return [ref for _, _, ref in entry.parts]
    if isinstance(entry, NestedValue):
        return list(entry.tensors)
    return []


def _stored_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except SafetensorError as exc:
        raise ValueError(
            f"{file}: not a readable safetensors file ({exc}): the file is truncated or "
            "corrupted; restore it or re-save the checkpoint"
        ) from None


def check_fits(
    index: Index,
    shapes: Sequence[Sequence[torch.Size]],
    dtypes: Sequence[torch.dtype],
    where: str,
    per_element: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Check that the checkpoint ``index`` belongs to params grouped as ``shapes``.

    State tensors are checked exactly as an in-memory ``load_state_dict`` checks them
    (:func:`oss_plus.state.index.state_shape_error`): only the keys of ``per_element`` must have
    their param's shape; any other state may legally have any shape.

    Args:
        index: the parsed index.
        shapes: per group, the shape of each param of the optimizer being loaded.
        dtypes: the dtype of each param, by flat index.
        where: the index path, for messages.
        per_element: the per-element state keys of the loading optimizer
            (:func:`oss_plus.state.index.per_element_keys`).

    Raises:
        ValueError: another number of groups or params, or a param of another shape or dtype.
    """
    fix = "load it into an optimizer over the same model and param groups"
    saved = [len(g["params"]) for g in index.param_groups]
    mine = [len(s) for s in shapes]
    if saved != mine:
        raise ValueError(
            f"{where}: the checkpoint has {len(saved)} param groups with {saved} params but the "
            f"optimizer has {len(mine)} groups with {mine} params: {fix}"
        )
    flat_shapes = [s for group in shapes for s in group]
    for i, (shape, torch_type) in enumerate(zip(flat_shapes, dtypes)):
        dtype = dtype_string(torch_type)
        info = index.params[i] if index.params is not None else None
        if info is not None and tuple(info["shape"]) != tuple(shape):
            raise ValueError(
                f"{where}: param {i} has shape {tuple(info['shape'])} in the checkpoint but "
                f"{tuple(shape)} in the optimizer: the checkpoint belongs to a different model; "
                f"{fix}"
            )
        if info is not None and info["dtype"] != dtype:
            raise ValueError(
                f"{where}: param {i} has dtype {info['dtype']} in the checkpoint but "
                f"{dtype} in the optimizer: {fix} (or cast the model back "
                "first; to change precision use read_state_dict() and load_state_dict())"
            )
        for key, ref in index.state.get(i, {}).items():
            if isinstance(ref, PiecesValue) and ref.shape != tuple(shape):
                raise ValueError(
                    f"{where}: state {i} key {key!r} is stored as pieces of a tensor of shape "
                    f"{ref.shape}, but param {i} has shape {tuple(shape)}: {fix}"
                )
            if isinstance(ref, (TensorRef, PiecesValue)):
                meta = torch.empty(ref.shape, device="meta")
                message = state_shape_error(i, key, meta, shape, per_element)
                if message:
                    raise ValueError(f"{where}: {message}; {fix}")
