"""What each rank writes in a save, as a frozen value (pure: no I/O, no collectives).

:func:`split_state` validates a rank's state and splits it into tensors and plain values;
:func:`describe` builds the index of the optimizer without files or state;
:class:`SavePlan` ties them to a save id, a target directory and this rank's file, and
:func:`tensor_slots` / :func:`file_header` lay the tensors out in a safetensors file. Every
rank computes the same layout from the same entries, so the consolidated stream needs no
negotiation. A tensor is addressed by its :data:`Slot`: top-level state tensors and the
tensors inside container values (:class:`~oss_plus.checkpoint.format.NestedValue`) and
this rank's pieces of params the flat rule splits
(:class:`~oss_plus.checkpoint.format.PiecesValue`) alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oss_plus.checkpoint.format import (
    CONSOLIDATED,
    SAVE_ID_KEY,
    SHARDED,
    Index,
    NestedValue,
    PiecesValue,
    PlainValue,
    TensorRef,
    consolidated_file,
    encode_groups,
    nested_names,
    piece_name,
    safetensors_header,
    shard_file,
    stage_path,
    tensor_name,
)
from oss_plus.checkpoint.values import dtype_name, dtype_string, torch_dtype
from oss_plus.state.index import own_group_keys, pack_param_groups
from oss_plus.state.layout import is_default_layout
from oss_plus.state.nested import encode_key, flatten_value
from oss_plus.state.subclass import is_plain

__all__ = [
    "NOT_OSS",
    "Entries",
    "SavePlan",
    "check_optimizer",
    "describe",
    "file_header",
    "local_pieces",
    "merge_entries",
    "nbytes_of",
    "replace_slots",
    "split_state",
    "tensor_slots",
]

#: Per param: state key -> tensor (before writing), TensorRef (after), PlainValue,
#: NestedValue or PiecesValue (holding tensors before writing, TensorRefs after).
Entries = dict[int, dict[Any, Any]]
#: Where a tensor is in entries: (flat index, state key, position in a NestedValue's tensors,
#: the start of a PiecesValue's part, or -1 for a top-level tensor).
Slot = tuple[int, str, int]
#: This rank's pieces of split params: flat index -> (start, end, the param's shape).
Pieces = dict[int, tuple[int, int, tuple[int, ...]]]
#: Raised when save/load is given something other than an oss_plus optimizer.
NOT_OSS = (
    "{fn} expects an oss_plus.OSS optimizer, got {kind}: for a plain torch optimizer use "
    "write_state_dict(optimizer.state_dict(), path) and "
    "optimizer.load_state_dict(read_state_dict(path))"
)


def check_optimizer(optimizer: Any, fn: str) -> None:
    """Raise TypeError (:data:`NOT_OSS`) unless ``optimizer`` is an :class:`oss_plus.OSS`."""
    from oss_plus.optimizer import OSS

    if not isinstance(optimizer, OSS):
        raise TypeError(NOT_OSS.format(fn=fn, kind=type(optimizer).__name__))


def local_pieces(optimizer: Any) -> Pieces:
    """Return the pieces ``optimizer``'s rank holds of the params its plan splits.

    Example:
        >>> local_pieces(opt)  # doctest: +SKIP
        {3: (40, 80, (10, 8))}
    """
    plan, shapes = optimizer.plan, [tuple(p.shape) for p in optimizer.flat_params()]
    mine = {i: plan.piece(optimizer.rank, i) for i in sorted(plan.split)}
    return {i: (p.start, p.end, shapes[i]) for i, p in mine.items() if p is not None}


def split_state(states: Mapping[int, Mapping[Any, Any]], pieces: Pieces | None = None) -> Entries:
    """Validate per-param state and split it into tensors, :class:`PlainValue`,
    :class:`NestedValue` entries (containers that hold tensors) and :class:`PiecesValue`
    entries; the tensors are not copied.

    For a param of ``pieces`` (this rank holds its elements ``[start, end)``), a state tensor
    of ``end - start`` elements, 1-D, is this rank's piece of a tensor shaped like the param
    (a :class:`PiecesValue` with one part); every other value is the param's, the same on
    every rank holding a piece, and is kept by the rank holding the first piece only (so it
    is stored once).

    Raises:
        TypeError: a key that holds a tensor, a dtype safetensors cannot store, a sparse
            tensor, or a value JSON cannot store (the message names the param, the key and
            the place).
    """
    entries: Entries = {}
    pieces = pieces or {}
    for i in sorted(states):
        entries[i] = {}
        for key, value in states[i].items():
            where = f"optimizer state of param {i}, key {key!r}"
            if not isinstance(key, str):
                encode_key(key, f"optimizer state of param {i}, key")
            if i in pieces:
                start, end, shape = pieces[i]
                if (
                    isinstance(value, torch.Tensor)
                    and is_plain(value)
                    and value.shape == (end - start,)
                ):
                    part = (start, end, _storable(value, where))
                    entries[i][key] = PiecesValue(shape, (part,))
                    continue
                if start != 0:  # the param's value: stored by the first piece's rank
                    continue
            if isinstance(value, torch.Tensor) and is_plain(value) and is_default_layout(value):
                entries[i][key] = _storable(value, where)
                continue
            skeleton, tensors = flatten_value(value, f"of param {i}, key {key!r}")
            if not tensors:  # a plain value (or a container of them): stored in the index
                entries[i][key] = PlainValue(value)
                continue
            names = nested_names(i, key, skeleton)
            entries[i][key] = NestedValue(
                skeleton, tuple(_storable(t, f"{where} at {n}") for t, n in zip(tensors, names))
            )
    return entries


def merge_entries(per_rank: Sequence[Entries]) -> Entries:
    """Merge the entries of every rank into those of the whole optimizer (PURE).

    A param held whole comes from one rank. Of a param cut into pieces, every rank holding
    one contributes a :class:`PiecesValue` per piece-shaped key, merged into one by start,
    and the rank of the first piece the param's other values; the key order is that rank's.
    Never raises (it runs on the coordinator alone, between collectives): should two ranks
    give a key otherwise than as pieces, the first piece's rank wins; readers check that the
    merged pieces cover their tensor (:func:`~oss_plus.checkpoint.entries.check_pieces`).
    """
    contributions: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for entries in per_rank:
        for i, entry in entries.items():
            starts = [v.parts[0][0] for v in entry.values() if isinstance(v, PiecesValue)]
            contributions.setdefault(i, []).append((min(starts, default=0), entry))
    merged: Entries = {}
    for i in sorted(contributions):
        merged[i] = {}
        for _, entry in sorted(contributions[i], key=lambda c: c[0]):
            for key, value in entry.items():
                have = merged[i].get(key)
                if have is None:
                    merged[i][key] = value
                elif isinstance(have, PiecesValue) and isinstance(value, PiecesValue):
                    merged[i][key] = have.merged(value)
    return merged


def _storable(tensor: torch.Tensor, where: str) -> torch.Tensor:
    dtype_name(tensor.dtype, where)
    if tensor.layout != torch.strided:
        raise TypeError(f"{where} is a {tensor.layout} tensor: save dense tensors only")
    return tensor


def describe(optimizer: Any, layout: str, save_id: str) -> Index:
    """Return the index of an :class:`oss_plus.OSS` without state or files (validated).

    Uses the optimizer's public contract only (``plan``, ``flat_params()``, ``param_groups``,
    ``optim``, ``world_size``).

    Raises:
        TypeError: a hyperparameter cannot be stored.
    """
    from oss_plus import __version__

    inner = type(optimizer.optim)
    params = [
        {"shape": list(p.shape), "dtype": dtype_string(p.dtype), "trainable": p.requires_grad}
        for p in optimizer.flat_params()
    ]
    groups = pack_param_groups(optimizer.param_groups, own_group_keys(optimizer.optim))
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


@dataclass(frozen=True)
class SavePlan:
    """One rank's part of one save: where it writes, what, and the index it completes.

    Attributes:
        target: the checkpoint directory (absolute).
        save_id: the id shared by every rank of the save.
        rank: this rank within the group; group rank 0 coordinates (writes the index and,
            in the consolidated layout, the only data file).
        world_size: the size of the group.
        entries: this rank's state (tensors and :class:`PlainValue`), by flat index.
        index: the index without files or state (:func:`describe`), the same on every rank.
    """

    target: Path
    save_id: str
    rank: int
    world_size: int
    entries: Entries
    index: Index

    @property
    def sharded(self) -> bool:
        """Whether every rank writes its own file (else group rank 0 writes one)."""
        return self.index.layout == SHARDED

    @property
    def coordinator(self) -> bool:
        """Whether this rank writes ``index.json`` and commits the save."""
        return self.rank == 0

    @property
    def stage(self) -> Path:
        """The temporary sibling directory the save is written into before the commit."""
        return stage_path(self.target, self.save_id)

    @property
    def file_name(self) -> str:
        """The data file this rank writes (sharded) or contributes to (consolidated)."""
        if self.sharded:
            return shard_file(self.rank, self.world_size, self.save_id)
        return consolidated_file(self.save_id)

    def refs(self) -> Entries:
        """This rank's entries with every tensor described as a :class:`TensorRef` (CRC 0)."""
        return replace_slots(
            self.entries,
            {
                slot: TensorRef(self.file_name, name, dtype_name(t.dtype, name), tuple(t.shape), 0)
                for slot, name, t in tensor_slots(self.entries)
            },
        )


def layout_of(sharded: bool) -> str:
    """Return the layout name for the ``sharded`` flag of a save."""
    return SHARDED if sharded else CONSOLIDATED


# ----------------------------------------------------------------------------- file layout
def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Return the size in bytes of a tensor of safetensors dtype ``dtype`` and ``shape``."""
    n = torch_dtype(dtype, "tensor").itemsize
    for s in shape:
        n *= s
    return n


def tensor_slots(entries: Mapping[int, Mapping[str, Any]]) -> list[tuple[Slot, str, Any]]:
    """Return every tensor of ``entries`` as ``(slot, name in the file, tensor or TensorRef)``,
    in file order.

    Larger element sizes first (so every tensor starts aligned to its element size), then by
    flat index, key order and position in a container (or start of a piece): every rank
    computes the same order from the same entries. Names are :func:`tensor_name` /
    :func:`nested_names` / :func:`piece_name` (those of TensorRefs are theirs); a name a
    param already uses gets ``~`` appended.
    """
    items: list[tuple[Slot, str, Any]] = []
    for i in sorted(entries):
        used: set[str] = set()
        for key, value in entries[i].items():
            if isinstance(value, (torch.Tensor, TensorRef)):
                items.append(((i, key, -1), _unique(value, tensor_name(i, key), used), value))
            elif isinstance(value, NestedValue):
                names = nested_names(i, key, value.skeleton)
                items.extend(
                    ((i, key, n), _unique(t, name, used), t)
                    for n, (name, t) in enumerate(zip(names, value.tensors))
                )
            elif isinstance(value, PiecesValue):
                items.extend(
                    ((i, key, a), _unique(t, piece_name(i, key, a), used), t)
                    for a, _, t in value.parts
                )
    return sorted(items, key=lambda item: -_itemsize(item[2]))


def _unique(value: torch.Tensor | TensorRef, name: str, used: set[str]) -> str:
    if isinstance(value, TensorRef):
        return value.name
    while name in used:
        name += "~"
    used.add(name)
    return name


def replace_slots(entries: Mapping[int, Mapping[str, Any]], new: Mapping[Slot, Any]) -> Entries:
    """Return ``entries`` (new dicts) with the tensor of every slot of ``new`` replaced."""
    out: Entries = {}
    for i, entry in entries.items():
        out[i] = {}
        for key, value in entry.items():
            if isinstance(value, NestedValue):
                tensors = tuple(new.get((i, key, n), t) for n, t in enumerate(value.tensors))
                value = NestedValue(value.skeleton, tensors)
            elif isinstance(value, PiecesValue):
                parts = tuple((a, b, new.get((i, key, a), t)) for a, b, t in value.parts)
                value = PiecesValue(value.shape, parts)
            out[i][key] = new.get((i, key, -1), value)
    return out


def _itemsize(value: torch.Tensor | TensorRef) -> int:
    if isinstance(value, TensorRef):
        return torch_dtype(value.dtype, value.name).itemsize
    return value.element_size()


def file_header(items: list[tuple[Slot, str, Any]], save_id: str) -> bytes:
    """Return the safetensors header for ``items`` of :func:`tensor_slots`."""
    described = []
    for _, name, value in items:
        if isinstance(value, TensorRef):
            size = nbytes_of(value.dtype, value.shape)
            described.append((value.name, value.dtype, value.shape, size))
        else:
            size = value.numel() * value.element_size()
            described.append((name, dtype_name(value.dtype, name), tuple(value.shape), size))
    return safetensors_header(described, {"format": "pt", SAVE_ID_KEY: save_id})
