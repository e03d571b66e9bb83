"""The on-disk format of oss_plus checkpoints: pure functions, no I/O, no collectives.

A checkpoint is a directory holding ``index.json`` and one or more safetensors files. The
index is the single source of truth: it lists the files, the param groups, the parameters
and, per parameter, every state key as a reference to a tensor in a file, as a JSON value,
(format version 2) as a JSON skeleton of a container whose tensors are in files, or (format
version 3) as the pieces of a tensor cut across ranks by the flat partition rule.
Python values are encoded with type tags so that tuples, ints, floats (inf and nan included),
bools and None come back exactly. ``docs/checkpoints.md`` is the specification.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oss_plus.checkpoint.entries import (
    NestedValue,
    PiecesValue,
    PlainValue,
    TensorRef,
    decode_state,
    encode_state,
    nested_names,
    piece_name,
    tensor_name,
)
from oss_plus.checkpoint.extras import EXTRAS_KEY, check_extras
from oss_plus.checkpoint.fields import BAD_FIELD, need, need_int, need_ints, need_list, need_str
from oss_plus.checkpoint.seal import seal
from oss_plus.checkpoint.values import decode_value, encode_value
from oss_plus.checkpoint.versions import check_entries, needs_version_5
from oss_plus.state.nested import holds_subclass

__all__ = [
    "CONSOLIDATED",
    "DATA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "SAVE_ID_KEY",
    "SHARDED",
    "Index",
    "NestedValue",
    "PiecesValue",
    "PlainValue",
    "TensorRef",
    "consolidated_file",
    "decode_groups",
    "decode_state",
    "encode_groups",
    "encode_state",
    "safetensors_header",
    "shard_file",
    "stage_path",
    "nested_names",
    "piece_name",
    "tensor_name",
]

#: Value of the ``format`` key of every index.
FORMAT_NAME = "oss_plus.optimizer_checkpoint"
#: The version this module writes, the newest it reads. Version 5 adds the checksum of the
#: index (:mod:`oss_plus.checkpoint.seal`), which every save writes, and what version-5
#: state may hold (:func:`needs_version_5`: sets, views, keys other than strings). Versions
#: 1-4 are read as before: 2 adds tensors inside containers (:class:`NestedValue`), 3
#: tensors stored as pieces (:class:`PiecesValue`), 4 tensor subclasses (torchao's low-bit
#: states in a :class:`NestedValue`); they carry no index checksum.
FORMAT_VERSION = 5
#: The version of an index that holds the inner optimizer's extras
#: (:mod:`oss_plus.checkpoint.extras`); one without them is written as :data:`FORMAT_VERSION`,
#: so readers of version 5 still read every checkpoint of a ``torch.optim`` class.
EXTRAS_VERSION = 6
#: The versions this module reads.
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
#: The first version whose index carries a checksum (and must).
SEALED_VERSION = 5
#: Name of the index inside a checkpoint directory (the commit point of a save).
INDEX_FILE = "index.json"
#: Key of the save id in the ``__metadata__`` of every data file.
SAVE_ID_KEY = "oss_plus.save_id"
#: Layout names.
SHARDED, CONSOLIDATED = "sharded", "consolidated"
#: Data files of a checkpoint: a per-rank shard or the consolidated file, with the save id.
DATA_FILE = re.compile(r"^(shard-\d{5,}-of-\d{5,}|state)\.[0-9a-f]{16}\.safetensors$")

#: Message for an index whose version this module cannot read.
BAD_VERSION = (
    "{where}: checkpoint format version {found!r}, but this oss_plus reads versions "
    f"{', '.join(map(str, READABLE_VERSIONS))} only: {{fix}}"
)


def shard_file(rank: int, world_size: int, save_id: str) -> str:
    """Return the name of the shard written by ``rank`` of ``world_size`` in save ``save_id``."""
    return f"shard-{rank:05d}-of-{world_size:05d}.{save_id}.safetensors"


def stage_path(path: Path, save_id: str) -> Path:
    """Return the temporary sibling directory of save ``save_id`` to checkpoint ``path``."""
    return path.parent / f".{path.name}.tmp-{save_id}"


def consolidated_file(save_id: str) -> str:
    """Return the name of the single data file of a consolidated save."""
    return f"state.{save_id}.safetensors"


def safetensors_header(
    tensors: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str]
) -> bytes:
    """Return the start of a safetensors file holding ``tensors`` in the given order.

    The result is the 8-byte little-endian header length followed by the JSON header
    (``dtype``, ``shape``, ``data_offsets`` per tensor, and ``__metadata__``), padded with
    spaces to a multiple of 8 bytes; the raw tensor bytes follow it back to back.

    Args:
        tensors: ``(name, dtype string, shape, nbytes)`` in file order.
        metadata: string-to-string metadata stored under ``__metadata__``.

    Example:
        >>> safetensors_header([("a", "F32", [2], 8)], {})[8:].rstrip()
        b'{"__metadata__":{},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body


# ----------------------------------------------------------------------------- the index
def encode_groups(param_groups: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, Any]]:
    """Encode packed param groups (``params`` are flat indices) for the index.

    Raises:
        TypeError: a key is not a string or a hyperparameter cannot be stored.
    """
    encoded = []
    for g, group in enumerate(param_groups):
        bad = [k for k in group if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: param group {g} has a non-string key {bad[0]!r}")
        entry = {
            k: encode_value(v, f"param group {g} key {k!r}")
            for k, v in group.items()
            if k != "params"
        }
        entry["params"] = [int(i) for i in group["params"]]
        encoded.append(entry)
    return encoded


def decode_groups(groups: Any, where: str) -> list[dict[str, Any]]:
    """Decode what :func:`encode_groups` produced (``params`` stay lists of ints).

    Raises:
        ValueError: not a list of objects, or a group without ``params`` (named).
    """
    if not isinstance(groups, list):
        problem = f"'param_groups' is {type(groups).__name__}, expected a list"
        raise ValueError(BAD_FIELD.format(where=where, problem=problem))
    decoded = []
    for g, group in enumerate(groups):
        at = f"{where}: param group {g}"
        params = need_ints(group, "params", at)
        entry = {k: decode_value(v, f"{at} key {k!r}") for k, v in group.items() if k != "params"}
        entry["params"] = params
        decoded.append(entry)
    return decoded


@dataclass(frozen=True)
class Index:
    """A parsed ``index.json`` (decoded Python values; JSON only at the boundary).

    ``state[i][key]`` is a :class:`TensorRef`, a :class:`PlainValue`, a :class:`NestedValue`
    or a :class:`PiecesValue`. ``params`` (shape,
    dtype string, trainable per flat index) and the saving optimizer, world size and
    partition are ``None`` for checkpoints converted from a plain state dict.
    """

    layout: str
    save_id: str
    param_groups: list[dict[str, Any]]
    files: dict[str, dict[str, int]]
    state: dict[int, dict[Any, TensorRef | PlainValue | NestedValue | PiecesValue]]
    params: list[dict[str, Any]] | None = None
    optimizer: str | None = None
    world_size: int | None = None
    partition: list[list[int]] | None = None
    partition_rule: str | None = None
    created_by: str = ""
    #: The version the index was read with (None: an index being written).
    read_version: int | None = field(default=None, compare=False)
    #: The index checksum it was read with (None: written, or an older format without one).
    index_crc32: int | None = field(default=None, compare=False)
    #: The inner optimizer's extras (``optimizer_extras``, :mod:`oss_plus.checkpoint.extras`).
    extras: dict[str, Any] | None = None

    @property
    def num_params(self) -> int:
        return sum(len(g["params"]) for g in self.param_groups)

    @property
    def format_version(self) -> int:
        """The version this index was read with, or is written with (:data:`FORMAT_VERSION`,
        :data:`EXTRAS_VERSION` when it holds extras)."""
        if self.read_version is not None:
            return self.read_version
        return FORMAT_VERSION if self.extras is None else EXTRAS_VERSION

    @property
    def content_version(self) -> int:
        """The lowest version that can hold this index's state (5: sets, views, keys other
        than strings; below 5, before checksums)."""
        if any(needs_version_5(entries) for entries in self.state.values()):
            return 5
        values = [v for e in self.state.values() for v in e.values()]
        kinds = {type(v) for v in values}
        if any(isinstance(v, NestedValue) and holds_subclass(v.skeleton) for v in values):
            return 4
        return 3 if PiecesValue in kinds else 2 if NestedValue in kinds else 1

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written to ``index.json``.

        Raises:
            TypeError: a hyperparameter or state value cannot be stored.
        """
        extras = {} if self.extras is None else {EXTRAS_KEY: self.extras}
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION if self.extras is None else EXTRAS_VERSION,
            "layout": self.layout,
            "save_id": self.save_id,
            "created_by": self.created_by,
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "partition_rule": self.partition_rule,
            "partition": self.partition,
            "num_params": self.num_params,
            "params": self.params,
            "param_groups": encode_groups(self.param_groups, "index"),
            "files": [{"name": n, **info} for n, info in self.files.items()],
            **extras,
            "state": encode_state(self.state),
        }

    def dumps(self) -> str:
        """Return the text of ``index.json``: one line per key, param, group, file and state,
        and last its checksum (:func:`oss_plus.checkpoint.seal.seal`).

        Raises:
            TypeError: a hyperparameter or state value cannot be stored.
        """

        def compact(value: Any) -> str:
            return json.dumps(value, separators=(", ", ": "), allow_nan=False)

        lines = []
        for key, value in self.to_json().items():
            if isinstance(value, list) and value:
                body = "[\n" + ",\n".join(f"  {compact(v)}" for v in value) + "\n ]"
            elif isinstance(value, dict) and value:
                body = (
                    "{\n"
                    + ",\n".join(f"  {compact(k)}: {compact(v)}" for k, v in value.items())
                    + "\n }"
                )
            else:
                body = compact(value)
            lines.append(f" {compact(key)}: {body}")
        return seal("{\n" + ",\n".join(lines) + "\n}\n")

    @classmethod
    def from_json(cls, data: Any, where: str) -> Index:
        """Validate and parse the JSON object of an index.

        Raises:
            ValueError: not an oss_plus index, another format version, or a malformed entry;
                the message names ``where`` (the index path) and the key.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ValueError(
                f"{where} is not an oss_plus checkpoint index (no format {FORMAT_NAME!r})"
            )
        version = data.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            fix = (
                "it was written by a newer oss_plus: upgrade oss_plus to read it"
                if isinstance(version, int) and version > FORMAT_VERSION
                else "the index is damaged or was not written by oss_plus; restore it "
                "from a backup or re-save the checkpoint"
            )
            raise ValueError(BAD_VERSION.format(where=where, found=version, fix=fix))
        try:
            return cls._parse(data, where)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if str(exc).startswith(where):
                raise
            raise ValueError(
                f"{where}: an entry of an unexpected form ({type(exc).__name__}: {exc}): the "
                "index is damaged or was not written by oss_plus; restore it from a backup or "
                "re-save the checkpoint"
            ) from None

    @classmethod
    def _parse(cls, data: dict[str, Any], where: str) -> Index:
        files = {}
        for n, f in enumerate(need_list(data, "files", where)):
            at = f"{where}: files[{n}]"
            files[need_str(f, "name", at)] = {
                "rank": need_int(f, "rank", at),
                "bytes": need_int(f, "bytes", at),
            }
        layout = need_str(data, "layout", where)
        if layout not in (SHARDED, CONSOLIDATED):
            raise ValueError(
                f"{where}: unknown layout {layout!r} (expected {SHARDED!r} or "
                f"{CONSOLIDATED!r}): the index is damaged; re-save the checkpoint"
            )
        state = decode_state(need(data, "state", where, dict), where, files)
        version = data["format_version"]
        check_entries(state, version, where)
        index = cls(
            layout=layout,
            save_id=need_str(data, "save_id", where),
            param_groups=decode_groups(need(data, "param_groups", where), where),
            files=files,
            state=state,
            params=_parse_params(data.get("params"), where),
            optimizer=data.get("optimizer"),
            world_size=data.get("world_size"),
            partition=data.get("partition"),
            partition_rule=data.get("partition_rule"),
            created_by=str(data.get("created_by", "")),
            read_version=version,
            extras=check_extras(data.get(EXTRAS_KEY), version, data.get("world_size"), where),
        )
        _check_counts(index, need_int(data, "num_params", where), where)
        return index


def _parse_params(params: Any, where: str) -> list[dict[str, Any]] | None:
    """Check every entry of ``params``: a shape (list of ints), a dtype string, a bool."""
    if params is None:
        return None
    if not isinstance(params, list):
        problem = f"'params' is {type(params).__name__}, expected a list or null"
        raise ValueError(BAD_FIELD.format(where=where, problem=problem))
    for i, info in enumerate(params):
        at = f"{where}: params[{i}]"
        need_ints(info, "shape", at)
        need_str(info, "dtype", at)
        need(info, "trainable", at, bool)
    return params


def _check_counts(index: Index, num_params: Any, where: str) -> None:
    flat = [i for g in index.param_groups for i in g["params"]]
    if flat != list(range(len(flat))) or num_params != len(flat):
        raise ValueError(
            f"{where}: 'num_params' is {num_params} and the param groups list the flat indices "
            f"{flat}, but they must list 0..{num_params - 1} once each, in order: the index is "
            "damaged; restore it or re-save the checkpoint"
        )
    if index.params is not None and len(index.params) != len(flat):
        raise ValueError(
            f"{where}: 'params' has {len(index.params)} entries for {len(flat)} params: the "
            "index is damaged; restore it or re-save the checkpoint"
        )
    unknown = [i for i in index.state if not 0 <= i < len(flat)]
    if unknown:
        raise ValueError(
            f"{where}: state for param {unknown[0]}, which no param group lists: the index is "
            "damaged; restore it or re-save the checkpoint"
        )
