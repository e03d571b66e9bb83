"""Saving a checkpoint: plan it (one collective phase), write it, commit it atomically.

:func:`save_checkpoint` is three steps, each a function of this module: :func:`make_plan`
(every rank validates its state, group rank 0 picks the save id and stages the directory:
the result is a frozen :class:`~oss_plus.checkpoint.plan.SavePlan`), :func:`execute` (write
this rank's file or stream to rank 0, complete the index, commit) and nothing else. Every
failure goes through :func:`oss_plus.runtime.dist.run_phase`, so it is raised on every rank and
the previous checkpoint stays whole.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from oss_plus.checkpoint import background, comm, storage
from oss_plus.checkpoint.extras import gather as gather_extras
from oss_plus.checkpoint.format import (
    Index,
    decode_state,
    encode_state,
)
from oss_plus.checkpoint.plan import (
    Entries,
    SavePlan,
    Slot,
    check_optimizer,
    describe,
    file_header,
    layout_of,
    local_pieces,
    merge_entries,
    nbytes_of,
    replace_slots,
    split_state,
    tensor_slots,
)
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist

__all__ = ["commit", "execute", "make_plan", "save_checkpoint"]

logger = logging.getLogger(__name__)

#: Length of a save id (hex digits).
_SAVE_ID_LENGTH = 16
#: A hook turning a rank's live entries into what the save writes (the async snapshot).
Snapshot = Callable[[Entries], Entries]


def save_checkpoint(
    optimizer: Any,
    path: str | os.PathLike[str],
    *,
    sharded: bool = True,
    blocking: bool = True,
) -> Future[str] | None:
    """Save the optimizer state to the directory ``path``, atomically.

    With ``sharded=True`` every rank writes the state of the params it owns to its own
    safetensors file, in parallel; no tensor travels between ranks. Under
    ``partition_rule="flat"`` a rank writes, of a param cut into pieces, its own piece of
    every state tensor (a ``pieces`` entry of format version 3; the ``step`` once, by the
    rank holding the first piece). With ``sharded=False``
    group rank 0 writes one consolidated file while the other ranks stream their tensors to it
    in chunks of at most 16 MiB, so no rank holds more than that beyond its own shard. Rank 0
    writes ``index.json`` (param groups, shapes, dtypes, partition, non-tensor state).

    Everything is first written to a temporary sibling directory and fsynced; the checkpoint
    at ``path`` is replaced only after every rank succeeded. If any rank fails (disk full, an
    exception, a killed process) the previous checkpoint at ``path`` stays complete, and every
    rank raises. Stale temporary siblings of interrupted saves are removed by the next save.
    A sharded save needs ``path`` on a filesystem every rank of the group can reach; a
    consolidated save only touches the filesystem on group rank 0.

    With ``blocking=False`` the call returns as soon as this rank's state is copied into
    reusable staging buffers (pinned CPU memory for GPU state, one shard's worth per rank);
    a background thread writes and commits the checkpoint over a gloo process group made
    for checkpoints, so the training may step, change params and state or load another
    state meanwhile: the checkpoint holds the state at the call. The returned future's
    result is ``path``; a failure on any rank is the future's exception on every rank and
    is raised again (as RuntimeError) by the next save. A save, blocking or not, first
    waits for the one in flight. See ``docs/checkpoints.md``.

    Under hybrid sharding (``OSS(..., replicate_group=...)``) one replica set writes (the
    ranks of replicate-group rank 0); the others write nothing and return (blocking) or
    complete their future (not blocking) when it committed, or raise what it raised.

    Args:
        optimizer: the :class:`oss_plus.OSS` optimizer.
        path: the checkpoint directory (created if needed; a previous checkpoint is replaced).
        sharded: one file per rank (fast, default) or one consolidated file.
        blocking: return after the commit (default), or right after the snapshot.

    Returns:
        None, or with ``blocking=False`` a :class:`concurrent.futures.Future` of ``path``.

    Raises:
        TypeError: ``optimizer`` is not an OSS, or its state holds a value that cannot be
            stored (raised before anything is written).
        NotADirectoryError: ``path`` is a file.
        ValueError: ``path`` holds an ``index.json`` that is not an oss_plus index.
        OSError: a write failed on some rank (every rank raises; ``path`` is unchanged).
        RuntimeError: the previous asynchronous save failed (raised once, on every rank).

    Example:
        >>> save_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP
        >>> load_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    check_optimizer(optimizer, "save_checkpoint")
    with _arrival.entry(optimizer.group, "save_checkpoint()", steps=optimizer.step_count):
        optimizer.settle()  # the last step's sync done and its status raised on every rank
        replicas = getattr(optimizer, "replicate_group", None)
        if replicas is not None:
            return _save_once(optimizer, path, sharded, blocking, replicas)
        return save_checkpoint_unreplicated(optimizer, path, sharded, blocking)


def _save_once(
    optimizer: Any, path: str | os.PathLike[str], sharded: bool, blocking: bool, replicas: Any
) -> Future[str] | None:
    """Hybrid sharding: replica set 0 (replicate-group rank 0) saves, the others write nothing.

    Every rank returns (blocking) or its future completes (not blocking) once the writers'
    commit is done, or raises naming the failed rank: the outcome is agreed over the
    replicate group (not blocking: over a checkpoint group of its ranks, in the saver's
    thread). torch's DCP needs nothing of this: every replica set offers the same chunks
    and DCP's planner keeps one writer per chunk (tests/test_dcp_hybrid.py).
    """
    writer = dist.get_rank(replicas) == 0
    if blocking:
        error = None
        if writer:
            _, error = _dist.capture(
                lambda: save_checkpoint_unreplicated(optimizer, path, sharded, blocking=True)
            )
        _dist.agree(error, replicas)
        return None
    saver = background.saver_of(optimizer)
    saver.settle()
    across = background.checkpoint_group(tuple(dist.get_process_group_ranks(replicas)))
    plan = make_plan(optimizer, path, sharded, snapshot=saver.staging.copy) if writer else None
    group = saver.group if writer else None

    def job() -> None:  # the writers save; every rank learns the outcome
        error = None
        if plan is not None:
            _, error = _dist.capture(lambda: execute(plan, group))
        _dist.agree(error, across)

    return saver.submit(job, Path(os.path.abspath(path)))


def save_checkpoint_unreplicated(
    optimizer: Any, path: str | os.PathLike[str], sharded: bool, blocking: bool
) -> Future[str] | None:
    """:func:`save_checkpoint` over the optimizer's group alone (one replica set).

    .. warning:: Collective: call on every rank of ``group``.
    """
    saver = background.saver_of(optimizer)
    saver.settle()
    if blocking:
        execute(make_plan(optimizer, path, sharded), optimizer.group)
        return None
    group = saver.group
    plan = make_plan(optimizer, path, sharded, snapshot=saver.staging.copy)
    return saver.submit(lambda: execute(plan, group), plan.target)


def make_plan(
    optimizer: Any, path: str | os.PathLike[str], sharded: bool, snapshot: Snapshot | None = None
) -> SavePlan:
    """Validate every rank's state, pick the save id, stage the directory (one phase).

    Args:
        optimizer: the :class:`oss_plus.OSS` optimizer (its public contract only).
        path: the checkpoint directory.
        sharded: the layout.
        snapshot: turns the live entries into those the save writes (default: the live ones).

    .. warning:: Collective: call on every rank of ``group``.
    """
    target, group, rank = Path(os.path.abspath(path)), optimizer.group, optimizer.rank
    made: dict[str, Any] = {"save_id": None}

    extras = gather_extras(optimizer, sharded)  # raises on every rank before any write

    def prepare() -> None:
        entries = split_state(optimizer.export_local_state(), local_pieces(optimizer))
        index = replace(describe(optimizer, layout_of(sharded), ""), extras=extras)
        if snapshot is not None:  # the index must not see later changes to the groups
            entries, index = snapshot(entries), copy.deepcopy(index)
        made["index"], made["entries"] = index, entries
        if rank == 0:
            made["save_id"] = storage.new_save_id()
            storage.prepare_stage(target, made["save_id"])

    def cleanup() -> None:
        if made["save_id"] is not None:
            storage.remove_stage(target, made["save_id"])

    _dist.run_phase(prepare, group, cleanup=cleanup)
    save_id = comm.broadcast_text(made["save_id"], _SAVE_ID_LENGTH, group)
    index = replace(made["index"], save_id=save_id)
    return SavePlan(target, save_id, rank, optimizer.world_size, made["entries"], index)


def execute(plan: SavePlan, group: Any) -> None:
    """Write the files of ``plan``, commit on group rank 0, remove the replaced save.

    .. warning:: Collective: call on every rank of ``group`` (the ranks of the plan).
    """
    cleanup = _cleanup(plan)
    write = _write_sharded if plan.sharded else _write_consolidated
    index = write(plan, group)
    replaced = _dist.run_phase(lambda: commit(plan, index), group, cleanup=cleanup)
    if plan.sharded:  # every rank can reach the directory: delete in parallel
        names = comm.broadcast_json(replaced, group)
        storage.remove_replaced(plan.target, names, plan.rank, plan.world_size)
    elif plan.coordinator:  # only rank 0 needs to reach it
        storage.remove_replaced(plan.target, replaced)
    comm.barrier(group)  # the replaced files are gone on every rank's return


def _cleanup(plan: SavePlan) -> Callable[[], None] | None:
    """What removes the stage directory after a failure (group rank 0 only)."""
    if not plan.coordinator:
        return None
    return lambda: storage.remove_stage(plan.target, plan.save_id)


def commit(plan: SavePlan, index: Index) -> list[str]:
    """On the coordinator: write ``index.json`` into the stage and commit (else nothing).

    Returns:
        The data files the commit replaced (on the coordinator; empty elsewhere).
    """
    if not plan.coordinator:
        return []
    storage.write_index(plan.stage, index)
    replaced = storage.commit(plan.stage, plan.target, index)
    logger.info("saved %s checkpoint %s to %s", index.layout, plan.save_id, plan.target)
    return replaced


def _write_sharded(plan: SavePlan, group: Any) -> Index:
    """Every rank writes its own file; the coordinator gathers the metadata (collective).

    Returns:
        The complete index on the coordinator, the plan's index elsewhere.
    """

    def write() -> tuple[int, Entries]:
        plan.stage.mkdir(parents=True, exist_ok=True)
        return storage.write_file(plan.stage / plan.file_name, plan.entries, plan.save_id)

    size, written = _dist.run_phase(write, group, cleanup=_cleanup(plan))
    meta = {"file": plan.file_name, "rank": plan.rank, "bytes": size}
    gathered = comm.gather_json({**meta, "state": encode_state(written)}, group)
    if gathered is None:
        return plan.index
    files = {m["file"]: {"rank": m["rank"], "bytes": m["bytes"]} for m in gathered}
    state = merge_entries([decode_state(m["state"], "gathered metadata", files) for m in gathered])
    return replace(plan.index, files=files, state=state)


def _write_consolidated(plan: SavePlan, group: Any) -> Index:
    """The coordinator writes one file; the others stream their tensors to it (collective).

    Returns:
        The complete index on the coordinator, the plan's index elsewhere.
    """
    gathered = comm.gather_json(encode_state(plan.refs()), group)
    if gathered is None:
        tensors = [t for _, _, t in tensor_slots(plan.entries)]
        sent_crcs, send_error = comm.send_tensors(tensors, group)
        comm.gather_json(sent_crcs, group)
        _dist.agree(send_error, group)
        return plan.index
    files = {plan.file_name: {"rank": 0, "bytes": 0}}
    owner: dict[Slot, int] = {}
    per_rank: list[Entries] = []
    for r, data in enumerate(gathered):
        decoded = decode_state(data, "gathered metadata", files)
        owner.update({slot: r for slot, _, _ in tensor_slots(decoded)})
        per_rank.append(decoded)
    state = merge_entries(per_rank)
    items = tensor_slots(state)
    size, crcs, error = _stream_to_file(plan, items, owner, group)
    remote = [iter(crcs_of_rank) for crcs_of_rank in comm.gather_json([], group) or []]
    _dist.agree(error, group, cleanup=_cleanup(plan))
    checked = {}
    for position, (slot, _, ref) in enumerate(items):
        crc = crcs[position] if owner[slot] == 0 else next(remote[owner[slot]])
        checked[slot] = replace(ref, crc32=crc)
    state = replace_slots(state, checked)
    return replace(plan.index, files={plan.file_name: {"rank": 0, "bytes": size}}, state=state)


def _stream_to_file(
    plan: SavePlan,
    items: list[tuple[Slot, str, Any]],
    owner: Mapping[Slot, int],
    group: Any,
) -> tuple[int, dict[int, int], Exception | None]:
    """On the coordinator: open the consolidated file, receive and write every tensor, fsync."""
    writer: storage.FileWriter | None = None
    error: Exception | None = None
    header = file_header(items, plan.save_id)
    try:
        writer = storage.open_writer(plan.stage / plan.file_name, header)
    except Exception as exc:  # noqa: BLE001 - the bytes are still received, then reported
        error = exc
    mine = {slot: tensor for slot, _, tensor in tensor_slots(plan.entries)}
    sources = [
        (owner[slot], mine.get(slot) if owner[slot] == 0 else None, nbytes_of(ref.dtype, ref.shape))
        for slot, _, ref in items
    ]
    crcs, write_error = comm.receive_to_file(sources, writer, len(header), group)
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
