"""``python -m oss_plus ckpt inspect PATH`` and ``ckpt convert IN.pt OUT_DIR``.

``inspect`` prints what a checkpoint holds (reading only its index, whose checksum it checks,
and the data files' headers, unless ``--verify``, which also reads and checks every tensor);
``convert`` migrates a ``.pt`` optimizer state dict (torch, fairscale OSS, torch ZeRO) to an
oss_plus checkpoint, reading it with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import torch

from oss_plus.checkpoint.format import Index, NestedValue, PiecesValue, PlainValue, TensorRef
from oss_plus.checkpoint.migrate import write_state_dict
from oss_plus.checkpoint.plan import nbytes_of
from oss_plus.checkpoint.read import read_state_dict
from oss_plus.checkpoint.validate import check_files, read_index
from oss_plus.state.nested import unflatten_value

__all__ = ["ProgressBar", "register"]

#: Raised when a .pt file holds no optimizer state dict at its top level or under --key.
NO_STATE_DICT = (
    "{file} holds no optimizer state dict{where} (a dict with 'state' and 'param_groups'); "
    "its top-level keys are {keys}: pass --key NAME to pick the entry that holds it"
)


def register(subparsers: Any) -> None:
    """Add the ``ckpt`` subcommand and its ``inspect`` / ``convert`` actions."""
    parser = subparsers.add_parser("ckpt", help="inspect or convert optimizer checkpoints")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    inspect = actions.add_parser("inspect", help="describe a checkpoint directory")
    inspect.add_argument("path", help="the checkpoint directory")
    inspect.add_argument(
        "--verify", action="store_true", help="also read every tensor and check its checksum"
    )
    inspect.set_defaults(func=_inspect)
    convert = actions.add_parser("convert", help="convert a .pt optimizer state dict")
    convert.add_argument("source", help="a .pt file holding an optimizer state dict")
    convert.add_argument("target", help="the checkpoint directory to write")
    convert.add_argument("--key", help="the entry of the .pt dict that holds the state dict")
    convert.set_defaults(func=_convert)


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)


class _Shown:
    """A tensor of the index as the table shows it: ``F32[6x6]`` (``of`` a reference)."""

    def __init__(self, text: str) -> None:
        self.text = text

    @classmethod
    def of(cls, ref: TensorRef) -> _Shown:
        return cls(f"{ref.dtype}[{'x'.join(map(str, ref.shape)) or 'scalar'}]")

    def __repr__(self) -> str:
        return self.text


def _shown_subclass(name: str, inner: Mapping[str, Any], *_: Any) -> _Shown:
    """A tensor subclass as ``Class(attr=dtype[shape], ...)`` (not rebuilt)."""
    fields = ", ".join(f"{attr}={value!r}" for attr, value in inner.items())
    return _Shown(f"{name.rsplit('.', 1)[-1]}({fields})")


def _state_cell(entries: Mapping[str, Any]) -> tuple[str, int]:
    parts, total = [], 0
    for key, entry in entries.items():
        if isinstance(entry, TensorRef):
            parts.append(f"{key}:{_Shown.of(entry)!r}")
            total += nbytes_of(entry.dtype, entry.shape)
        elif isinstance(entry, NestedValue):  # the value, its tensors as dtype[shape]
            refs = [_Shown.of(ref) for ref in entry.tensors]
            shown = unflatten_value(entry.skeleton, refs, on_subclass=_shown_subclass)
            parts.append(f"{key}={shown!r}")
            total += sum(nbytes_of(ref.dtype, ref.shape) for ref in entry.tensors)
        elif isinstance(entry, PiecesValue):  # the stitched tensor, and its pieces count
            first = entry.parts[0][2]
            shown = TensorRef(first.file, first.name, first.dtype, entry.shape, 0)
            parts.append(f"{key}:{_Shown.of(shown)!r}/{len(entry.parts)}pieces")
            total += sum(nbytes_of(ref.dtype, ref.shape) for _, _, ref in entry.parts)
        elif isinstance(entry, PlainValue):
            parts.append(f"{key}={entry.value!r}")
    return " ".join(parts) or "-", total


def _print_summary(root: Path, index: Index, out: TextIO) -> None:
    version, layout = index.format_version, index.layout
    print(f"checkpoint {root}: format v{version}, {layout} layout, save {index.save_id}", file=out)
    print(f"checksum:   {_checksum_line(index)}", file=out)
    print(f"created by: {index.created_by or 'unknown'}", file=out)
    print(f"optimizer:  {index.optimizer or 'unknown (converted from a state dict)'}", file=out)
    saved = f"{index.world_size} ranks" if index.world_size else "unknown world size"
    print(f"saved on:   {saved}, partition rule {index.partition_rule or '-'}", file=out)
    total = sum(f["bytes"] for f in index.files.values())
    print(f"files:      {len(index.files)}, {_size(total)}", file=out)
    files = [
        ["  " + name, f"rank {f['rank']}", _size(f["bytes"])] for name, f in index.files.items()
    ]
    _table(files, out)
    print(f"groups:     {len(index.param_groups)}", file=out)
    for g, group in enumerate(index.param_groups):
        hyper = ", ".join(f"{k}={v!r}" for k, v in group.items() if k != "params")
        print(f"  group {g}: {len(group['params'])} params; {hyper}", file=out)
    print(f"params:     {index.num_params} ({len(index.state)} with state)", file=out)


def _checksum_line(index: Index) -> str:
    """What covers the index: its checksum (checked on reading), or that it carries none."""
    if index.index_crc32 is not None:
        return f"index.json crc32 {index.index_crc32:08x} (matches)"
    return (
        f"no index checksum (format v{index.format_version} predates it; re-save with this "
        "oss_plus to add one)"
    )


def _param_rows(index: Index) -> list[list[str]]:
    rows = [["index", "group", "rank", "shape", "dtype", "trainable", "bytes", "state"]]
    owners = [o for group in index.partition or [] for o in group]
    for g, group in enumerate(index.param_groups):
        for i in group["params"]:
            info = index.params[i] if index.params else {}
            cell, nbytes = _state_cell(index.state.get(i, {}))
            shape = "x".join(map(str, info["shape"])) or "scalar" if "shape" in info else "?"
            trainable = {"True": "yes", "False": "no"}.get(str(info.get("trainable")), "?")
            rank = str(owners[i]) if owners else "?"
            dtype = info.get("dtype", "?")
            rows.append([str(i), str(g), rank, shape, dtype, trainable, _size(nbytes), cell])
    return rows


def _stored_tensors(index: Index) -> int:
    """The number of tensors the data files of ``index`` hold (every piece counts)."""
    count = 0
    for entries in index.state.values():
        for v in entries.values():
            if isinstance(v, NestedValue):
                count += len(v.tensors)
            elif isinstance(v, PiecesValue):
                count += len(v.parts)
            else:
                count += isinstance(v, TensorRef)
    return count


def _inspect(args: argparse.Namespace) -> int:
    root = Path(args.path)
    index = read_index(root)
    check_files(root, index)
    _print_summary(root, index, sys.stdout)
    _table(_param_rows(index), sys.stdout)
    if args.verify:
        read_state_dict(root)  # reads every stored tensor whole: checks every checksum
        print(f"verified:   {_stored_tensors(index)} tensors match their checksums")
    return 0


class ProgressBar:
    """A text progress bar on a stream (stderr), redrawn when the percentage changes."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.label, self.width = label, width
        self.stream = sys.stderr if stream is None else stream
        self._shown = -1
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        percent = 100 if total == 0 else done * 100 // total
        if percent == self._shown:
            return
        self._shown = percent
        filled = self.width * percent // 100
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._start
        self.stream.write(
            f"\r{self.label} [{bar}] {percent:3d}% {_size(done)}/{_size(total)} {elapsed:.1f}s"
        )
        if percent == 100:
            self.stream.write("\n")
        self.stream.flush()


def _load_pt(source: Path) -> Any:
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist")
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(source, map_location="cpu", weights_only=True)  # legacy format


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and {"state", "param_groups"} <= set(value)


def _pick(data: Any, key: str | None, source: Path) -> Mapping[str, Any]:
    keys = sorted(map(str, data)) if isinstance(data, Mapping) else type(data).__name__
    if key is not None:
        if not isinstance(data, Mapping) or key not in data or not _is_state_dict(data[key]):
            raise ValueError(NO_STATE_DICT.format(file=source, where=f" under {key!r}", keys=keys))
        return data[key]
    if _is_state_dict(data):
        return data
    candidates = (
        [k for k, v in data.items() if _is_state_dict(v)] if isinstance(data, Mapping) else []
    )
    if len(candidates) == 1:
        print(f"using the optimizer state dict under {candidates[0]!r}", file=sys.stderr)
        return data[candidates[0]]
    raise ValueError(NO_STATE_DICT.format(file=source, where="", keys=keys))


def _convert(args: argparse.Namespace) -> int:
    source, target = Path(args.source), Path(args.target)
    try:
        data = _load_pt(source)
    except Exception as exc:
        if isinstance(exc, (FileNotFoundError, ValueError)):
            raise
        raise ValueError(
            f"{source} cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): it holds objects other than "
            "tensors and plain containers; save only the optimizer state dict and retry"
        ) from None
    state_dict = _pick(data, args.key, source)
    write_state_dict(state_dict, target, progress=ProgressBar(f"converting {source.name}"))
    index = read_index(target)
    tensors = _stored_tensors(index)
    size = sum(f["bytes"] for f in index.files.values())
    print(f"wrote {target}: {index.num_params} params, {tensors} tensors, {_size(size)}")
    return 0
