"""Safetensors checkpoints of a sharded optimizer: save, load at any world size, convert.

A checkpoint is a directory: ``index.json`` (everything that is not a tensor, as type-tagged
JSON) plus safetensors files holding the state tensors. ``save_checkpoint(sharded=True)``
has every rank write the state it owns, in parallel, with no tensor leaving its rank;
``sharded=False`` streams every rank's tensors to rank 0 into one file in bounded chunks.
``load_checkpoint`` works for both layouts at any world size: each rank reads only the
tensors it owns now. Saves are atomic (the index is replaced last, after every rank
succeeded) and nothing on a load path unpickles anything. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from oss_plus import _ckpt_comm, _ckpt_io, _ckpt_read, _ckpt_save, _dist
from oss_plus._ckpt_format import (
    CONSOLIDATED,
    INDEX_FILE,
    SHARDED,
    Index,
    consolidated_file,
    encode_groups,
)
from oss_plus.optimizer import OSS
from oss_plus.state import NOT_A_STATE_DICT, pack_param_groups, saved_state_by_flat_index

__all__ = ["load_checkpoint", "read_state_dict", "save_checkpoint", "write_state_dict"]

logger = logging.getLogger(__name__)

#: Raised when save/load is given something other than an oss_plus optimizer.
NOT_OSS = (
    "{fn} expects an oss_plus.OSS optimizer, got {kind}: for a plain torch optimizer use "
    "write_state_dict(optimizer.state_dict(), path) and "
    "optimizer.load_state_dict(read_state_dict(path))"
)
#: Length of a save id (hex digits).
_SAVE_ID_LENGTH = 16


def _check_optimizer(optimizer: Any, fn: str) -> None:
    if not isinstance(optimizer, OSS):
        raise TypeError(NOT_OSS.format(fn=fn, kind=type(optimizer).__name__))


def save_checkpoint(optimizer: OSS, path: str | os.PathLike[str], *, sharded: bool = True) -> None:
    """Save the optimizer state to the directory ``path``, atomically.

    With ``sharded=True`` every rank writes the state of the params it owns to its own
    safetensors file, in parallel; no tensor travels between ranks. With ``sharded=False``
    group rank 0 writes one consolidated file while the other ranks stream their tensors to it
    in chunks of at most 16 MiB, so no rank holds more than that beyond its own shard. Rank 0
    writes ``index.json`` (param groups, shapes, dtypes, partition, non-tensor state).

    Everything is first written to a temporary sibling directory and fsynced; the checkpoint
    at ``path`` is replaced only after every rank succeeded. If any rank fails (disk full, an
    exception, a killed process) the previous checkpoint at ``path`` stays complete, and every
    rank raises. Stale temporary siblings of interrupted saves are removed by the next save.
    A sharded save needs ``path`` on a filesystem every rank of the group can reach; a
    consolidated save only touches the filesystem on group rank 0.

    Args:
        optimizer: the :class:`oss_plus.OSS` optimizer.
        path: the checkpoint directory (created if needed; a previous checkpoint is replaced).
        sharded: one file per rank (fast, default) or one consolidated file.

    Raises:
        TypeError: ``optimizer`` is not an OSS, or its state holds a value that cannot be
            stored (raised before anything is written).
        NotADirectoryError: ``path`` is a file.
        ValueError: ``path`` holds an ``index.json`` that is not an oss_plus index.
        OSError: a write failed on some rank (every rank raises; ``path`` is unchanged).

    Example:
        >>> save_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP
        >>> load_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    _check_optimizer(optimizer, "save_checkpoint")
    target, group, rank = Path(os.path.abspath(path)), optimizer.group, optimizer.rank
    entries: _ckpt_io.Entries = {}
    index: Index | None = None
    save_id: str | None = None
    error: Exception | None = None
    try:
        entries = _ckpt_save.plan_states(optimizer.export_local_state())
        if rank == 0:
            save_id = _ckpt_io.new_save_id()
            index = _ckpt_save.describe(optimizer, SHARDED if sharded else CONSOLIDATED, save_id)
            _ckpt_io.prepare_stage(target, save_id)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    _dist.agree(error, group, cleanup=_ckpt_save.stage_cleanup(target, save_id, rank))
    save_id = _ckpt_comm.broadcast_text(save_id, _SAVE_ID_LENGTH, group)
    cleanup = _ckpt_save.stage_cleanup(target, save_id, rank)
    write = _ckpt_save.write_sharded if sharded else _ckpt_save.write_consolidated
    index = write(optimizer, target, save_id, entries, index)
    error = None
    if index is not None:  # group rank 0
        try:
            stage = _ckpt_io.stage_path(target, save_id)
            _ckpt_io.write_index(stage, index)
            _ckpt_io.commit(stage, target, index)
            logger.info("saved %s checkpoint %s to %s", index.layout, save_id, target)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    _dist.agree(error, group, cleanup=cleanup)
    if sharded:  # every rank can reach path: delete in parallel
        _ckpt_io.remove_replaced(target, save_id, rank, optimizer.world_size)
    elif rank == 0:  # only rank 0 needs to reach path
        _ckpt_io.remove_replaced(target, save_id)
    _ckpt_comm.barrier(group)  # the replaced files are gone on every rank's return


def load_checkpoint(optimizer: OSS, path: str | os.PathLike[str]) -> None:
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
    _check_optimizer(optimizer, "load_checkpoint")
    root, group = Path(path), optimizer.group
    error: Exception | None = None
    index: Index | None = None
    states: dict[int, dict[str, Any]] = {}
    try:
        index = _ckpt_read.read_index(root)
        _ckpt_read.check_files(root, index)
        shapes = [[p.shape for p in g["params"]] for g in optimizer.param_groups]
        dtypes = [p.dtype for p in optimizer.flat_params()]
        _ckpt_read.check_fits(index, shapes, dtypes, str(root / INDEX_FILE))
        _warn_other_optimizer(index, optimizer)
        states = _ckpt_read.read_states(root, index, optimizer.plan.owned(optimizer.rank))
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    _dist.agree(error, group)
    assert index is not None
    try:
        optimizer.import_local_state(states, index.param_groups)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    _dist.agree(error, group)


def _warn_other_optimizer(index: Index, optimizer: OSS) -> None:
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
    index = _ckpt_read.read_index(root)
    _ckpt_read.check_files(root, index)
    state = _ckpt_read.read_states(root, index, range(index.num_params))
    return {"state": state, "param_groups": index.param_groups}


def write_state_dict(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write a plain ``torch.optim`` state dict as a consolidated oss_plus checkpoint.

    The migration path for existing checkpoints: a dict from ``torch.optim``, from fairscale's
    ``OSS.state_dict()`` or from torch's ``ZeroRedundancyOptimizer.state_dict()``, e.g. read
    from a ``.pt`` file with ``torch.load(file, weights_only=True)``. The write is atomic like
    :func:`save_checkpoint`. Param shapes are not recorded (a plain dict does not have them);
    loading still checks the state tensors against the params.

    Args:
        state_dict: ``{"state": {id: {key: value}}, "param_groups": [...]}``; not modified.
        path: the checkpoint directory.
        progress: called with ``(bytes written, bytes total)`` as the tensors are written.

    Raises:
        ValueError: ``state_dict`` is not in the torch.optim format.
        TypeError: a value cannot be stored (checked before anything is written).

    Example:
        >>> sd = torch.load("optim.pt", map_location="cpu", weights_only=True)  # doctest: +SKIP
        >>> write_state_dict(sd, "ckpt/migrated")  # doctest: +SKIP
    """
    from oss_plus import __version__

    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        keys = (
            sorted(map(str, state_dict))
            if isinstance(state_dict, Mapping)
            else type(state_dict).__name__
        )
        raise ValueError(NOT_A_STATE_DICT.format(keys=keys))
    try:
        by_flat = saved_state_by_flat_index(state_dict)
        groups = pack_param_groups(state_dict["param_groups"])
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"the state dict is not in the torch.optim format ({type(exc).__name__}: {exc}): "
            "every param group needs a 'params' list and every state id must be listed in one"
        ) from None
    entries = _ckpt_save.plan_states(by_flat)
    target, save_id = Path(os.path.abspath(path)), _ckpt_io.new_save_id()
    index = Index(CONSOLIDATED, save_id, groups, {}, {}, created_by=f"oss_plus {__version__}")
    encode_groups(groups, "param_groups")
    stage = _ckpt_io.prepare_stage(target, save_id)
    try:
        name = consolidated_file(save_id)
        size, written = _ckpt_io.write_file(stage / name, entries, save_id, progress)
        index = replace(index, files={name: {"rank": 0, "bytes": size}}, state=written)
        _ckpt_io.write_index(stage, index)
        _ckpt_io.commit(stage, target, index)
    except BaseException:
        _ckpt_io.remove_stage(target, save_id)
        raise
    _ckpt_io.remove_replaced(target, save_id)
