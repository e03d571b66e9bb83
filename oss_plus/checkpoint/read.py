"""Reading checkpoints: :func:`load_checkpoint`, :func:`read_state_dict` and their checks.

No pickle: the index is JSON, tensors come from ``safe_open`` one by one, and only the
tensors asked for are read (each rank reads the params it owns now, so any world size loads
any checkpoint). The only collectives are the two phases of :func:`load_checkpoint`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from oss_plus import _arrival, _dist
from oss_plus._nested import unflatten_value
from oss_plus.checkpoint.format import (
    INDEX_FILE,
    SAVE_ID_KEY,
    Index,
    NestedValue,
    PiecesValue,
    TensorRef,
)
from oss_plus.checkpoint.plan import check_optimizer, local_pieces, nbytes_of
from oss_plus.checkpoint.storage import crc32_of
from oss_plus.checkpoint.values import dtype_name, dtype_string
from oss_plus.main_copy import MAIN_KEY
from oss_plus.state import per_element_keys, state_shape_error

__all__ = [
    "check_files",
    "check_fits",
    "load_checkpoint",
    "read_index",
    "read_state_dict",
    "read_states",
]

logger = logging.getLogger(__name__)

#: Message when the data files of a directory come from two different saves.
OTHER_SAVE = (
    "{file}: this file belongs to save {found!r} but {index} is from save {expected!r}: the "
    "directory mixes files of two saves; restore the matching file or re-save the checkpoint"
)


def load_checkpoint(optimizer: Any, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint saved by :func:`save_checkpoint` or :func:`write_state_dict`.

    Works for both layouts at any world size and under any partition rule, whatever the
    rule that saved it: each rank reads (lazily, with ``safe_open``) only the tensors of the
    params it owns now, and checks their dtype, shape and checksum. State stored as pieces
    (``partition_rule="flat"``) is stitched for a param this rank holds whole; of a param
    it holds a piece of (flat rule), only the stored elements of that piece are read (a
    stored tensor larger than :data:`PARTIAL_READ_BYTES` needed in part is read with
    ``get_slice``, which checks dtype and shape but not the checksum).
    Param groups are restored exactly (``betas`` stays a tuple, ints stay ints) and
    non-tensor state comes from JSON; nothing is unpickled. Everything is validated before
    the optimizer is touched; an error on any rank is raised on every rank.

    Args:
        optimizer: the :class:`oss_plus.OSS` optimizer over the same model and param groups.
        path: the checkpoint directory.

    Raises:
        TypeError: ``optimizer`` is not an OSS.
        FileNotFoundError: no checkpoint at ``path``, or one of its files is missing.
        ValueError: a truncated or corrupted file, an index of another format version,
            pieces that do not cover their tensor, or a checkpoint of a different model
            (count, shape or dtype mismatch); the message names the file and the mismatch.

    Example:
        >>> load_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    check_optimizer(optimizer, "load_checkpoint")
    with _arrival.entry(optimizer.group, "load_checkpoint()"):
        _load(optimizer, Path(path))


def _load(optimizer: Any, root: Path) -> None:
    """The body of :func:`load_checkpoint`, once every rank entered it."""
    optimizer.settle()  # the last step's sync done and its status raised on every rank

    def read() -> tuple[Index, dict[int, dict[str, Any]]]:
        index = read_index(root)
        check_files(root, index)
        shapes = [[p.shape for p in g["params"]] for g in optimizer.param_groups]
        dtypes = [p.dtype for p in optimizer.flat_params()]
        per_element = per_element_keys(optimizer.optim) | {MAIN_KEY}  # exact values too
        check_fits(index, shapes, dtypes, str(root / INDEX_FILE), per_element)
        _warn_other_optimizer(index, optimizer)
        pieces = {i: (start, end) for i, (start, end, _) in local_pieces(optimizer).items()}
        shapes_by_index = [tuple(s) for group in shapes for s in group]
        owned = optimizer.plan.owned(optimizer.rank)
        return index, read_states(root, index, owned, pieces, shapes_by_index)

    index, states = _dist.run_phase(read, optimizer.group)
    _dist.run_phase(
        lambda: optimizer.import_local_state(states, index.param_groups), optimizer.group
    )


def _warn_other_optimizer(index: Index, optimizer: Any) -> None:
    saved = (index.optimizer or "").rpartition(".")[2]
    mine = type(optimizer.optim).__qualname__
    if saved and saved != mine:
        logger.warning(
            "checkpoint %s was saved from a %s optimizer; loading it into a %s",
            index.save_id,
            saved,
            mine,
        )


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the checkpoint at ``path`` as a plain ``torch.optim`` state dict.

    Needs no process group. The result equals the consolidated ``state_dict()`` of the
    optimizer that saved it (dtypes included; state saved as pieces is stitched into whole
    tensors) and loads into a plain torch optimizer, an
    :class:`oss_plus.OSS`, fairscale's OSS or torch's ZeroRedundancyOptimizer. Every tensor
    is checksummed; nothing is unpickled.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` or a missing file.
        ValueError: a truncated or corrupted file, an index of another format version, or
            pieces that do not cover their tensor.

    Example:
        >>> torch_optimizer.load_state_dict(read_state_dict("ckpt/step_1000"))  # doctest: +SKIP
    """
    root = Path(path)
    index = read_index(root)
    check_files(root, index)
    state = read_states(root, index, range(index.num_params))
    return {"state": state, "param_groups": index.param_groups}


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
            return unflatten_value(entry.skeleton, tensors, f"state[{i}][{key!r}]")
        return copy.deepcopy(entry.value)

    return {i: {k: value_of(i, k, v) for k, v in index.state[i].items()} for i in wanted}


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


def check_fits(
    index: Index,
    shapes: Sequence[Sequence[torch.Size]],
    dtypes: Sequence[torch.dtype],
    where: str,
    per_element: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Check that the checkpoint ``index`` belongs to params grouped as ``shapes``.

    State tensors are checked exactly as an in-memory ``load_state_dict`` checks them
    (:func:`oss_plus.state.state_shape_error`): only the keys of ``per_element`` must have
    their param's shape; any other state may legally have any shape.

    Args:
        index: the parsed index.
        shapes: per group, the shape of each param of the optimizer being loaded.
        dtypes: the dtype of each param, by flat index.
        where: the index path, for messages.
        per_element: the per-element state keys of the loading optimizer
            (:func:`oss_plus.state.per_element_keys`).

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
