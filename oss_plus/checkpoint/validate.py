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
from pathlib import Path
from typing import Any

import torch

from oss_plus.checkpoint.format import INDEX_FILE, Index, PiecesValue, TensorRef
from oss_plus.checkpoint.values import dtype_string
from oss_plus.state.index import state_shape_error

__all__ = ["check_files", "check_fits", "read_index"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def read_index(path: Path) -> Index:
    """Read and validate ``path/index.json``.

    Raises:
        FileNotFoundError: no directory or no index at ``path``.
        ValueError: the index is not valid JSON, not an oss_plus index, or of another version.
    """
    file = path / INDEX_FILE
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist")
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} holds no {INDEX_FILE}: it is not an oss_plus checkpoint, or its first save "
            "did not complete"
        )
    try:
        data = json.loads(file.read_text("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc}): the index is damaged; re-save") from None
    return Index.from_json(data, str(file))


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
