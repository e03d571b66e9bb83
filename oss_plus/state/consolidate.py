"""Collectives that move optimizer state between ranks, tensor by tensor.

Used to consolidate the state on one rank or on all ranks, and to hand the state of a
parameter to its new owner when the partition changes. State may nest tensors inside
lists, tuples and dicts (:mod:`oss_plus.state.nested`): its structure, dtypes and shapes travel
as JSON text (nothing is pickled); tensors move with ``send``/``recv`` (one recipient) or
``broadcast`` (all ranks), so a rank that receives nothing allocates nothing, and the
recipient's extra memory is the state it receives plus one bounded packing buffer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.planning.plan import ShardPlan
from oss_plus.runtime.dist import (
    all_gather_bytes,
    comm_device,
    global_rank,
    message_plan,
    released,
    run_phase,
)
from oss_plus.state.index import ParamState
from oss_plus.state.nested import flatten_param_state, unflatten_value
from oss_plus.state.pieces import stitch_state

__all__ = ["ALL_RANKS", "Transfer", "assemble", "exchange_states", "whole_states"]

logger = logging.getLogger(__name__)

#: Destination meaning "every rank of the group".
ALL_RANKS = -1
#: Where consolidated tensors land by default.
CPU = torch.device("cpu")
#: Small tensors are packed into messages of at most this many bytes.
PACK_BYTES = 16 << 20
#: Tensors at least this large travel alone, without a packing copy.
ALONE_BYTES = 1 << 20
#: dtypes some backends cannot move (gloo: float8, int16 and the wide unsigned ints; torchao's
#: ``AdamWFp8`` keeps float8 codes), sent bit for bit as their bytes (uint8).
AS_BYTES: frozenset[torch.dtype] = frozenset(
    dtype
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "int16",
        "uint16",
        "uint32",
        "uint64",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
)


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


#: One tensor to move: the transfer, its number in the state's flattening, its metadata.
_Slot = tuple[Transfer, int, _TensorMeta]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"state metadata names an unknown dtype {name!r}")
    return dtype


def _describe(flat: tuple[Any, list[torch.Tensor]]) -> dict[str, Any]:
    """The JSON metadata of a flattened state: its skeleton, and dtype/shape per tensor."""
    skeleton, tensors = flat
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    return {"skeleton": skeleton, "tensors": specs}


def _gather_metas(
    my_meta: dict[int, dict[str, Any]], group: Any
) -> list[dict[int, tuple[Any, list[_TensorMeta]]]]:
    """All-gather every rank's metadata as JSON text; parse it back (ints keys, dtypes)."""
    texts = all_gather_bytes(json.dumps({str(i): m for i, m in my_meta.items()}).encode(), group)
    metas = []
    for text in texts:
        parsed = json.loads(text)
        metas.append(
            {
                int(i): (m["skeleton"], [_TensorMeta(_dtype(d), tuple(s)) for d, s in m["tensors"]])
                for i, m in parsed.items()
            }
        )
    return metas


def _to(value: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``value`` on ``device`` (the same tensor when it is there already, or for None)."""
    return value if device is None else value.to(device)


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
    Tensors nested in lists, tuples and dicts move like top-level ones.

    Args:
        local_states: state of the params this rank owns, by flat index.
        transfers: what moves where; a source without state for an index sends nothing.
        group: the process group; ranks in ``transfers`` are group-local.
        out_device: where received tensors land (None: keep the communication device).

    Returns:
        The states whose destination is this rank (or all ranks), by flat index.

    Raises:
        TypeError: a state value has no JSON form (e.g. an arbitrary object); raised on
            every rank.

    .. warning:: Collective: call on every rank of ``group``.
    """
    rank = dist.get_rank(group)
    sending = [t.index for t in transfers if t.src == rank and t.index in local_states]
    mine = run_phase(
        lambda: {i: flatten_param_state(local_states[i], f"state[{i}]") for i in sending}, group
    )
    metas = _gather_metas({i: _describe(flat) for i, flat in mine.items()}, group)

    skeletons: dict[int, Any] = {}
    arrived: dict[int, list[Any]] = {}
    slots: list[_Slot] = []
    for t in sorted(transfers, key=lambda t: (t.src, t.dst, t.index)):
        if t.index not in metas[t.src]:
            continue
        skeleton, tensor_metas = metas[t.src][t.index]
        if t.dst in (rank, ALL_RANKS):
            skeletons[t.index] = skeleton
            arrived[t.index] = [None] * len(tensor_metas)
        for n, meta in enumerate(tensor_metas):
            if t.src == rank and t.dst in (rank, ALL_RANKS):  # served from local tensors
                arrived[t.index][n] = _to(mine[t.index][1][n], out_device)
            if t.src != t.dst:
                slots.append((t, n, meta))
    device = comm_device(group)
    sources = {i: tensors for i, (_, tensors) in mine.items()}
    sizes = [math.prod(meta.shape) * meta.dtype.itemsize for _, _, meta in slots]
    kinds = [(t.src, t.dst, meta.dtype) for t, _, meta in slots]
    for message in message_plan(sizes, pack_bytes=PACK_BYTES, alone_bytes=ALONE_BYTES, kinds=kinds):
        run = [slots[i] for i, _, _ in message]
        _move_run(run, sources, arrived, rank, group, device, out_device)
    for (t, n, meta), size in zip(slots, sizes):  # empty tensors travel in no message
        if size == 0 and t.index in arrived and t.src != rank:
            empty = torch.empty(meta.shape, dtype=meta.dtype, device=out_device or device)
            arrived[t.index][n] = empty
    return {i: unflatten_value(skeletons[i], arrived[i], f"state[{i}]") for i in sorted(skeletons)}


def _move_run(
    run: list[_Slot],
    sources: Mapping[int, list[torch.Tensor]],
    arrived: dict[int, list[Any]],
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
    numels = [math.prod(meta.shape) for _, _, meta in run]
    if rank == head.src:
        parts = [sources[t.index][n].detach().reshape(-1) for t, n, _ in run]
        buffer = parts[0] if len(parts) == 1 else torch.cat(parts)
        buffer = buffer.to(device).contiguous()
        buffer = buffer.view(torch.uint8) if dtype in AS_BYTES else buffer
    elif dtype in AS_BYTES:
        buffer = torch.empty(sum(numels) * dtype.itemsize, dtype=torch.uint8, device=device)
    else:
        buffer = torch.empty(sum(numels), dtype=dtype, device=device)
    src = global_rank(group, head.src)
    with torch.profiler.record_function("oss_plus::exchange_states"), released(group, buffer):
        if head.dst == ALL_RANKS:
            dist.broadcast(buffer, src=src, group=group)
        elif rank == head.src:
            dist.send(buffer, dst=global_rank(group, head.dst), group=group)
        else:
            dist.recv(buffer, src=src, group=group)
    if rank != head.dst and head.dst != ALL_RANKS:
        return
    if rank == head.src:  # a broadcast source keeps its own tensors (set when planning)
        return
    buffer = buffer.view(dtype)
    pieces = buffer.split(numels) if len(run) > 1 else [buffer]
    for (t, n, meta), piece in zip(run, pieces):
        value = piece.view(meta.shape)
        moved = value.to(out_device) if out_device is not None else value
        if len(run) > 1 and moved.device == buffer.device:
            moved = moved.clone()  # do not keep the whole packing buffer alive
        arrived[t.index][n] = moved


def whole_states(
    local_states: Mapping[int, ParamState],
    plan: ShardPlan,
    destinations: Mapping[int, Sequence[int]] | int,
    shapes: Sequence[torch.Size],
    group: Any,
    out_device: torch.device | None = None,
) -> dict[int, ParamState]:
    """Send the state of params to ranks, whole: the pieces of a split param are stitched.

    Every rank holding a piece of param ``i`` under ``plan`` (whose states ``local_states``
    are, keyed by flat index) sends it to each of ``destinations[i]`` (an ``int`` for every
    param: a rank or :data:`ALL_RANKS`), which stitches the whole state
    (:func:`oss_plus.state.pieces.stitch_state`). Under a whole-tensor plan this is one transfer per
    param and destination, from its owner.

    Args:
        local_states: this rank's states by flat index (pieces for split params).
        plan: the plan ``local_states`` were held under.
        destinations: flat index -> the ranks that need its whole state, or one rank
            (or :data:`ALL_RANKS`) for every param.
        shapes: the shape of every param, by flat index.
        group: the process group.
        out_device: where received tensors land (None: the communication device).

    Returns:
        The whole states this rank is a destination of, by flat index (params without state
        are absent).

    .. warning:: Collective: call on every rank of ``group`` with the same arguments but
        ``local_states``.
    """
    world = plan.world_size
    if isinstance(destinations, int):
        destinations = {i: [destinations] for i in range(plan.num_params)}
    by_index = plan.by_index
    transfers = [
        Transfer(i * world + piece.owner, piece.owner, dst)
        for i, dsts in destinations.items()
        for piece in by_index.get(i, ())
        for dst in dsts
    ]
    rank = dist.get_rank(group)
    keyed = {i * world + rank: s for i, s in local_states.items()}
    received = exchange_states(keyed, transfers, group, out_device=out_device)
    return assemble(received, plan, shapes)


def assemble(
    received: Mapping[int, ParamState], plan: ShardPlan, shapes: Sequence[torch.Size]
) -> dict[int, ParamState]:
    """The whole states of the pieces in ``received`` (keyed ``index * world_size + owner``
    under ``plan``): a param held whole is its owner's state, a split one is stitched
    (:func:`oss_plus.state.pieces.stitch_state`)."""
    world, by_index = plan.world_size, plan.by_index
    parts: dict[int, list[tuple[int, int, ParamState]]] = {}
    for key in sorted(received):
        i, owner = divmod(key, world)
        piece = next(p for p in by_index[i] if p.owner == owner)
        parts.setdefault(i, []).append((piece.start, piece.end, received[key]))
    return {
        i: got[0][2] if len(by_index[i]) == 1 else stitch_state(got, shapes[i], i)
        for i, got in parts.items()
    }
