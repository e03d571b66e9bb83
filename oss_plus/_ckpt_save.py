"""Saving a checkpoint: validate the state, then write it sharded or streamed to rank 0.

Called by :func:`oss_plus.checkpoint.save_checkpoint`; the collectives are those of
:mod:`oss_plus._ckpt_comm` (no pickle), the files those of :mod:`oss_plus._ckpt_io`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from oss_plus import _ckpt_comm, _ckpt_io, _ckpt_stream, _dist
from oss_plus._ckpt_format import (
    Index,
    PlainValue,
    TensorRef,
    consolidated_file,
    decode_state,
    encode_groups,
    encode_state,
    shard_file,
    tensor_name,
)
from oss_plus._ckpt_values import dtype_name, dtype_string, encode_value
from oss_plus.optimizer import OSS
from oss_plus.state import pack_param_groups

__all__ = ["describe", "plan_states", "stage_cleanup", "write_consolidated", "write_sharded"]


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_has_tensor(v) for v in value)


def plan_states(states: Mapping[int, Mapping[str, Any]]) -> _ckpt_io.Entries:
    """Validate per-param state and split it into tensors and :class:`PlainValue` entries.

    Raises:
        TypeError: a non-string key, a dtype safetensors cannot store, a sparse tensor,
            tensors inside a container, or a value JSON cannot store.
    """
    entries: _ckpt_io.Entries = {}
    for i in sorted(states):
        entries[i] = {}
        for key, value in states[i].items():
            where = f"optimizer state of param {i}, key {key!r}"
            if not isinstance(key, str):
                raise TypeError(f"{where}: state keys must be strings to be saved")
            if isinstance(value, torch.Tensor):
                dtype_name(value.dtype, where)
                if value.layout != torch.strided:
                    raise TypeError(f"{where} is a {value.layout} tensor: save dense tensors only")
                entries[i][key] = value
            elif _has_tensor(value):
                raise TypeError(
                    f"{where} holds tensors inside a {type(value).__name__}; checkpoints store "
                    "per-param state made of tensors and plain values only"
                )
            else:
                encode_value(value, where)
                entries[i][key] = PlainValue(value)
    return entries


def describe(optimizer: OSS, layout: str, save_id: str) -> Index:
    """Return the index of ``optimizer`` without state or files (validated, rank 0)."""
    from oss_plus import __version__

    inner = type(optimizer.optim)
    params = [
        {"shape": list(p.shape), "dtype": dtype_string(p.dtype), "trainable": p.requires_grad}
        for p in optimizer.flat_params()
    ]
    groups = pack_param_groups(optimizer.param_groups)
    encode_groups(groups, "param_groups")
    return Index(
        layout=layout,
        save_id=save_id,
        param_groups=groups,
        files={},
        state={},
        params=params,
        optimizer=f"{inner.__module__}.{inner.__qualname__}",
        world_size=optimizer.world_size,
        partition=optimizer.plan.owners_by_group(),
        partition_rule=optimizer.plan.rule.value,
        created_by=f"oss_plus {__version__}",
    )


def stage_cleanup(target: Path, save_id: str | None, rank: int) -> Callable[[], None] | None:
    """Return what removes the stage directory after a failure (group rank 0 only)."""
    if rank != 0 or save_id is None:
        return None
    return lambda: _ckpt_io.remove_stage(target, save_id)


def write_sharded(
    optimizer: OSS, target: Path, save_id: str, entries: _ckpt_io.Entries, index: Index | None
) -> Index | None:
    """Every rank writes its own shard; rank 0 gathers the small metadata (collective)."""
    group, rank = optimizer.group, optimizer.rank
    stage = _ckpt_io.stage_path(target, save_id)
    name = shard_file(rank, optimizer.world_size, save_id)
    error: Exception | None = None
    size, written = 0, {}  # type: tuple[int, _ckpt_io.Entries]
    try:
        stage.mkdir(parents=True, exist_ok=True)
        size, written = _ckpt_io.write_file(stage / name, entries, save_id)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    _dist.agree(error, group, cleanup=stage_cleanup(target, save_id, rank))
    meta = {"file": name, "rank": rank, "bytes": size, "state": encode_state(written)}
    gathered = _ckpt_comm.gather_json(meta, group)
    if gathered is None or index is None:
        return None
    files = {m["file"]: {"rank": m["rank"], "bytes": m["bytes"]} for m in gathered}
    state: dict[int, dict[str, TensorRef | PlainValue]] = {}
    for m in gathered:
        state.update(decode_state(m["state"], "gathered metadata", files))
    return replace(index, files=files, state=dict(sorted(state.items())))


def write_consolidated(
    optimizer: OSS, target: Path, save_id: str, entries: _ckpt_io.Entries, index: Index | None
) -> Index | None:
    """Rank 0 writes one file; the others stream their tensors to it in chunks (collective)."""
    group, rank = optimizer.group, optimizer.rank
    name = consolidated_file(save_id)
    described = {
        i: {
            k: TensorRef(name, tensor_name(i, k), dtype_name(v.dtype, k), tuple(v.shape), 0)
            if isinstance(v, torch.Tensor)
            else v
            for k, v in e.items()
        }
        for i, e in entries.items()
    }
    gathered = _ckpt_comm.gather_json(encode_state(described), group)
    if gathered is None or index is None:
        tensors = [t for _, _, t in _ckpt_io.file_order(entries)]
        sent_crcs, send_error = _ckpt_stream.send_tensors(tensors, group)
        _ckpt_comm.gather_json(sent_crcs, group)
        _dist.agree(send_error, group)
        return None
    files = {name: {"rank": 0, "bytes": 0}}
    owner: dict[tuple[int, str], int] = {}
    state: dict[int, dict[str, TensorRef | PlainValue]] = {}
    for r, data in enumerate(gathered):
        decoded = decode_state(data, "gathered metadata", files)
        owner.update({(i, k): r for i, e in decoded.items() for k in e})
        state.update(decoded)
    state = dict(sorted(state.items()))
    items = _ckpt_io.file_order(state)
    size, crcs, error = _stream_to_file(target, save_id, items, owner, entries, group)
    remote = [iter(crcs_of_rank) for crcs_of_rank in _ckpt_comm.gather_json([], group) or []]
    _dist.agree(error, group, cleanup=stage_cleanup(target, save_id, rank))
    for position, (i, k, ref) in enumerate(items):
        crc = crcs[position] if owner[i, k] == 0 else next(remote[owner[i, k]])
        state[i][k] = replace(ref, crc32=crc)
    return replace(index, files={name: {"rank": 0, "bytes": size}}, state=state)


def _stream_to_file(
    target: Path,
    save_id: str,
    items: list[tuple[int, str, Any]],
    owner: Mapping[tuple[int, str], int],
    entries: _ckpt_io.Entries,
    group: Any,
) -> tuple[int, dict[int, int], Exception | None]:
    """On rank 0: open the consolidated file, receive and write every tensor, fsync it."""
    writer: _ckpt_io.FileWriter | None = None
    error: Exception | None = None
    file = _ckpt_io.stage_path(target, save_id) / consolidated_file(save_id)
    header = _ckpt_io.file_header(items, save_id)
    try:
        writer = _ckpt_io.open_writer(file, header)
    except Exception as exc:  # noqa: BLE001 - the bytes are still received, then reported
        error = exc
    plan = [
        (
            owner[i, k],
            entries[i][k] if owner[i, k] == 0 else None,
            _ckpt_io.nbytes_of(ref.dtype, ref.shape),
        )
        for i, k, ref in items
    ]
    crcs, write_error = _ckpt_stream.receive_to_file(plan, writer, len(header), group)
    error = error or write_error
    size = 0
    if writer is not None:
        try:
            if error is None:
                size = writer.finish()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            error = exc
        finally:
            writer.close()
    return size, crcs, error
