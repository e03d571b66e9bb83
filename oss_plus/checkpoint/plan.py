"""What each rank writes in a save, as a frozen value (pure: no I/O, no collectives).

:func:`split_state` validates a rank's state and splits it into tensors and plain values;
:func:`describe` builds the index of the optimizer without files or state;
:class:`SavePlan` ties them to a save id, a target directory and this rank's file, and
:func:`file_order` / :func:`file_header` lay the tensors out in a safetensors file. Every
rank computes the same layout from the same entries, so the consolidated stream needs no
negotiation.
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
    PlainValue,
    TensorRef,
    consolidated_file,
    encode_groups,
    safetensors_header,
    shard_file,
    stage_path,
    tensor_name,
)
from oss_plus.checkpoint.values import dtype_name, dtype_string, encode_value, torch_dtype
from oss_plus.state import pack_param_groups

__all__ = [
    "NOT_OSS",
    "Entries",
    "SavePlan",
    "check_optimizer",
    "describe",
    "file_header",
    "file_order",
    "nbytes_of",
    "split_state",
]

#: Per param: state key -> tensor (before writing), TensorRef (after) or PlainValue.
Entries = dict[int, dict[str, Any]]
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


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_has_tensor(v) for v in value)


def split_state(states: Mapping[int, Mapping[str, Any]]) -> Entries:
    """Validate per-param state and split it into tensors and :class:`PlainValue` entries.

    Raises:
        TypeError: a non-string key, a dtype safetensors cannot store, a sparse tensor,
            tensors inside a container, or a value JSON cannot store.
    """
    entries: Entries = {}
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
        return {
            i: {
                k: TensorRef(
                    self.file_name, tensor_name(i, k), dtype_name(v.dtype, k), tuple(v.shape), 0
                )
                if isinstance(v, torch.Tensor)
                else v
                for k, v in e.items()
            }
            for i, e in self.entries.items()
        }


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


def file_order(entries: Mapping[int, Mapping[str, Any]]) -> list[tuple[int, str, Any]]:
    """Return the tensor entries ``(index, key, tensor or TensorRef)`` in file order.

    Larger element sizes first (so every tensor starts aligned to its element size), then by
    flat index and key order: every rank computes the same order from the same entries.
    """
    items = [
        (i, k, v)
        for i in sorted(entries)
        for k, v in entries[i].items()
        if isinstance(v, (torch.Tensor, TensorRef))
    ]
    return sorted(items, key=lambda item: -_itemsize(item[2]))


def _itemsize(value: torch.Tensor | TensorRef) -> int:
    if isinstance(value, TensorRef):
        return torch_dtype(value.dtype, value.name).itemsize
    return value.element_size()


def file_header(items: list[tuple[int, str, Any]], save_id: str) -> bytes:
    """Return the safetensors header for ``items`` in :func:`file_order`."""
    described = []
    for i, key, value in items:
        if isinstance(value, TensorRef):
            size = nbytes_of(value.dtype, value.shape)
            described.append((value.name, value.dtype, value.shape, size))
        else:
            dtype = dtype_name(value.dtype, f"optimizer state of param {i}, key {key!r}")
            size = value.numel() * value.element_size()
            described.append((tensor_name(i, key), dtype, tuple(value.shape), size))
    return safetensors_header(described, {"format": "pt", SAVE_ID_KEY: save_id})
