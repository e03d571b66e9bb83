"""Collectives that move optimizer state between ranks, tensor by tensor.

Used to consolidate the state on one rank or on all ranks, and to hand the state of a
parameter to its new owner when the partition changes. Only small metadata (dtypes, shapes,
plain values such as a step count) travels as a pickled object; tensors move with
``send``/``recv`` (one recipient) or ``broadcast`` (all ranks), so a rank that receives
nothing allocates nothing, and the recipient's extra memory is the state it receives plus one
bounded packing buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._dist import comm_device, global_rank, message_plan
from oss_plus.state import ParamState

__all__ = ["ALL_RANKS", "Transfer", "exchange_states"]

logger = logging.getLogger(__name__)

#: Destination meaning "every rank of the group".
ALL_RANKS = -1
#: Where consolidated tensors land by default.
CPU = torch.device("cpu")
#: Small tensors are packed into messages of at most this many bytes.
PACK_BYTES = 16 << 20
#: Tensors at least this large travel alone, without a packing copy.
ALONE_BYTES = 1 << 20


@dataclass(frozen=True)
class Transfer:
    """Move the state of flat index ``index`` from rank ``src`` to ``dst`` (or ALL_RANKS)."""

    index: int
    src: int
    dst: int


@dataclass(frozen=True)
class _TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]


def _describe(state: ParamState) -> dict[str, Any]:
    """Replace the tensors of ``state`` by their metadata (what travels as an object)."""
    meta: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            meta[key] = _TensorMeta(value.dtype, tuple(value.shape))
        elif isinstance(value, (list, tuple, dict)) and _holds_tensor(value):
            raise NotImplementedError(
                f"optimizer state key {key!r} holds tensors inside a {type(value).__name__}; "
                "oss_plus moves per-param state made of tensors and plain values only"
            )
        else:
            meta[key] = value
    return meta


def _holds_tensor(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(
        isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple, dict)) and _holds_tensor(v))
        for v in items
    )


def _to(value: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``value`` on ``device`` (the same tensor when it is there already, or for None)."""
    return value if device is None else value.to(device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def exchange_states(
    local_states: Mapping[int, ParamState],
    transfers: list[Transfer],
    group: Any,
    out_device: torch.device | None = CPU,
) -> dict[int, ParamState]:
    """Carry out ``transfers`` (collective) and return the states this rank received.

    Every rank must pass the same ``transfers`` list (the plan is computed from shared
    partition data); ranks take part only in the messages they send or receive, except for
    ``ALL_RANKS`` destinations, which are broadcasts. A transfer whose ``src`` equals this
    rank's ``dst`` is served locally (the caller's tensors are returned as they are).

    Args:
        local_states: state of the params this rank owns, by flat index.
        transfers: what moves where; a source without state for an index sends nothing.
        group: the process group; ranks in ``transfers`` are group-local.
        out_device: where received tensors land (None: keep the communication device).

    Returns:
        The states whose destination is this rank (or all ranks), by flat index.

    .. warning:: Collective: call on every rank of ``group``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    my_meta = {
        t.index: _describe(local_states[t.index])
        for t in transfers
        if t.src == rank and t.index in local_states
    }
    metas: list[dict[int, dict[str, Any]] | None] = [None] * world
    dist.all_gather_object(metas, my_meta, group=group)

    received: dict[int, ParamState] = {}
    slots: list[tuple[Transfer, str, _TensorMeta]] = []
    for t in sorted(transfers, key=lambda t: (t.src, t.dst, t.index)):
        meta = (metas[t.src] or {}).get(t.index)
        if meta is None:
            continue
        mine = t.dst in (rank, ALL_RANKS)
        if mine:
            received[t.index] = {k: v for k, v in meta.items() if not isinstance(v, _TensorMeta)}
        for key, value in meta.items():
            if isinstance(value, _TensorMeta):
                if t.src == t.dst == rank:
                    received[t.index][key] = _to(local_states[t.index][key], out_device)
                elif t.src != t.dst:
                    slots.append((t, key, value))
    device = comm_device(group)
    sizes = [_numel(meta.shape) * meta.dtype.itemsize for _, _, meta in slots]
    kinds = [(t.src, t.dst, meta.dtype) for t, _, meta in slots]
    for message in message_plan(sizes, pack_bytes=PACK_BYTES, alone_bytes=ALONE_BYTES, kinds=kinds):
        run = [slots[i] for i, _, _ in message]
        _move_run(run, local_states, received, rank, group, device, out_device)
    for (t, key, empty), size in zip(slots, sizes):  # empty tensors travel in no message
        if size == 0 and t.index in received:
            own = t.src == rank
            received[t.index][key] = (
                _to(local_states[t.index][key], out_device)
                if own
                else torch.empty(empty.shape, dtype=empty.dtype, device=out_device or device)
            )
    return received


def _move_run(
    run: list[tuple[Transfer, str, _TensorMeta]],
    local_states: Mapping[int, ParamState],
    received: dict[int, ParamState],
    rank: int,
    group: Any,
    device: torch.device,
    out_device: torch.device | None,
) -> None:
    """Send, receive or broadcast one message made of the tensors of ``run``."""
    head = run[0][0]
    if rank not in (head.src, head.dst) and head.dst != ALL_RANKS:
        return
    dtype = run[0][2].dtype
    numels = [_numel(meta.shape) for _, _, meta in run]
    if rank == head.src:
        parts = [local_states[t.index][key].detach().reshape(-1) for t, key, _ in run]
        buffer = parts[0] if len(parts) == 1 else torch.cat(parts)
        buffer = buffer.to(device).contiguous()
    else:
        buffer = torch.empty(sum(numels), dtype=dtype, device=device)
    src = global_rank(group, head.src)
    with torch.profiler.record_function("oss_plus::exchange_states"):
        if head.dst == ALL_RANKS:
            dist.broadcast(buffer, src=src, group=group)
        elif rank == head.src:
            dist.send(buffer, dst=global_rank(group, head.dst), group=group)
        else:
            dist.recv(buffer, src=src, group=group)
    if rank != head.dst and head.dst != ALL_RANKS:
        return
    if rank == head.src:  # a broadcast source keeps its own tensors
        for t, key, _ in run:
            received[t.index][key] = _to(local_states[t.index][key], out_device)
        return
    pieces = buffer.split(numels) if len(run) > 1 else [buffer]
    for (t, key, meta), piece in zip(run, pieces):
        value = piece.view(meta.shape)
        moved = value.to(out_device) if out_device is not None else value
        if len(run) > 1 and moved.device == buffer.device:
            moved = moved.clone()  # do not keep the whole packing buffer alive
        received[t.index][key] = moved
