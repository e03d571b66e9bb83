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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from oss_plus import _dist
from oss_plus._nested import unflatten_value
from oss_plus.checkpoint.format import INDEX_FILE, SAVE_ID_KEY, Index, NestedValue, TensorRef
from oss_plus.checkpoint.plan import check_optimizer
from oss_plus.checkpoint.storage import crc32_of
from oss_plus.checkpoint.values import dtype_name, dtype_string, torch_dtype
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

    Works for both layouts at any world size: each rank reads (lazily, with ``safe_open``)
    only the tensors of the params it owns now, and checks their dtype, shape and checksum.
    Param groups are restored exactly (``betas`` stays a tuple, ints stay ints) and
    non-tensor state comes from JSON; nothing is unpickled. Everything is validated before
    the optimizer is touched; an error on any rank is raised on every rank.

    Args:
        optimizer: the :class:`oss_plus.OSS` optimizer over the same model and param groups.
        path: the checkpoint directory.

    Raises:
        TypeError: ``optimizer`` is not an OSS.
        FileNotFoundError: no checkpoint at ``path``, or one of its files is missing.
        ValueError: a truncated or corrupted file, an index of another format version, or a
            checkpoint of a different model (count, shape or dtype mismatch); the message
            names the file and the mismatch.

    Example:
        >>> load_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    check_optimizer(optimizer, "load_checkpoint")
    root = Path(path)

    def read() -> tuple[Index, dict[int, dict[str, Any]]]:
        index = read_index(root)
        check_files(root, index)
        shapes = [[p.shape for p in g["params"]] for g in optimizer.param_groups]
        dtypes = [p.dtype for p in optimizer.flat_params()]
        per_element = per_element_keys(optimizer.optim)
        check_fits(index, shapes, dtypes, str(root / INDEX_FILE), per_element)
        _warn_other_optimizer(index, optimizer)
        return index, read_states(root, index, optimizer.plan.owned(optimizer.rank))

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
    optimizer that saved it (dtypes included) and loads into a plain torch optimizer, an
    :class:`oss_plus.OSS`, fairscale's OSS or torch's ZeroRedundancyOptimizer. Every tensor
    is checksummed; nothing is unpickled.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` or a missing file.
        ValueError: a truncated or corrupted file or an index of another format version.

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


def read_states(path: Path, index: Index, indices: Iterable[int]) -> dict[int, dict[str, Any]]:
    """Read the state of the params ``indices`` only (lazy per-tensor reads, checksummed).

    Raises:
        ValueError: a file is unreadable, from another save, or a tensor differs from the
            index (dtype, shape, checksum). The message names the file and the tensor.
    """
    wanted = sorted(i for i in set(indices) if i in index.state)
    by_file: dict[str, list[TensorRef]] = {}
    for i in wanted:
        for entry in index.state[i].values():
            for ref in entry.tensors if isinstance(entry, NestedValue) else (entry,):
                if isinstance(ref, TensorRef):
                    by_file.setdefault(ref.file, []).append(ref)
    tensors: dict[str, torch.Tensor] = {}
    with torch.profiler.record_function("oss_plus::checkpoint_read"):
        for name, listed in by_file.items():
            tensors.update(_read_file(path / name, listed, index.save_id, path / INDEX_FILE))

    def value_of(entry: Any, where: str) -> Any:
        if isinstance(entry, TensorRef):
            return tensors[entry.name]
        if isinstance(entry, NestedValue):
            return unflatten_value(entry.skeleton, [tensors[r.name] for r in entry.tensors], where)
        return copy.deepcopy(entry.value)

    return {
        i: {k: value_of(v, f"state[{i}][{k!r}]") for k, v in index.state[i].items()} for i in wanted
    }


def _read_file(
    file: Path, refs: list[TensorRef], save_id: str, index_file: Path
) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            found = (handle.metadata() or {}).get(SAVE_ID_KEY)
            if found != save_id:
                raise ValueError(
                    OTHER_SAVE.format(file=file, found=found, index=index_file, expected=save_id)
                )
            return {ref.name: _read_tensor(handle, file, ref) for ref in refs}
    except SafetensorError as exc:
        raise ValueError(
            f"{file}: not a readable safetensors file ({exc}): the file is truncated or corrupted; "
            "restore it or re-save the checkpoint"
        ) from None


def _read_tensor(handle: Any, file: Path, ref: TensorRef) -> torch.Tensor:
    if ref.name not in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
        raise ValueError(
            f"{file}: no tensor {ref.name!r}, which the index places in this file: the file does "
            "not match its index; restore it or re-save the checkpoint"
        )
    tensor = handle.get_tensor(ref.name)
    if tensor.dtype != torch_dtype(ref.dtype, ref.name) or tuple(tensor.shape) != ref.shape:
        raise ValueError(
            f"{file}: tensor {ref.name!r} is {dtype_name(tensor.dtype, ref.name)} "
            f"{tuple(tensor.shape)} but the index records {ref.dtype} {ref.shape}: the file does "
            "not match its index; restore it or re-save the checkpoint"
        )
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
            if isinstance(ref, TensorRef):
                meta = torch.empty(ref.shape, device="meta")
                message = state_shape_error(i, key, meta, shape, per_element)
                if message:
                    raise ValueError(f"{where}: {message}; {fix}")
