"""Writing checkpoint files: streamed safetensors writes, staging and the atomic commit.

No collectives here; reading is :mod:`oss_plus.checkpoint.read`. A save writes into a temporary
sibling directory (``.<name>.tmp-<save id>``), fsyncs every file, and :func:`commit` moves
the data files into the checkpoint directory under names that include the save id (so they
never overwrite the previous save's files) and then replaces ``index.json`` with one atomic
``os.replace``: the index is the commit point. Until it is replaced, the previous checkpoint
is complete.

Saves from several process groups to one path (two optimizers on disjoint subgroups) are
safe: the coordinator holds an advisory ``flock`` on its stage directory while the save is in
flight (a later save's sweep of stale stages skips it), and :func:`commit` runs under a lock
on the checkpoint directory, where it lists the files it replaces. So a commit only removes
files that were replaced before it committed, never the files of a later commit: exactly one
complete checkpoint survives. Where the filesystem has no ``flock`` (some network
filesystems), a commit removes only the files named by the index it replaced (never a
concurrent save's), and a stale stage is left in place rather than risk a live one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from oss_plus.checkpoint import locks
from oss_plus.checkpoint.format import (
    DATA_FILE,
    FORMAT_NAME,
    INDEX_FILE,
    Index,
    TensorRef,
    stage_path,
)
from oss_plus.checkpoint.plan import Entries, Slot, file_header, replace_slots, tensor_slots
from oss_plus.checkpoint.values import dtype_name

__all__ = [
    "CHUNK_BYTES",
    "byte_chunks",
    "byte_view",
    "commit",
    "crc32_of",
    "new_save_id",
    "open_writer",
    "prepare_stage",
    "remove_replaced",
    "remove_stage",
    "write_file",
]

logger = logging.getLogger(__name__)

#: Tensors are written, sent and received in pieces of at most this many bytes.
CHUNK_BYTES = 16 << 20
#: ``progress(bytes_done, bytes_total)``.
Progress = Callable[[int, int], None]


def new_save_id() -> str:
    """Return a fresh random save id (16 lowercase hex digits)."""
    return secrets.token_hex(8)


# ----------------------------------------------------------------------------- writing
def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return the raw little-endian bytes of ``tensor`` as a flat uint8 tensor.

    A view of the tensor's memory (on its device) when it is contiguous, else a copy.

    Raises:
        NotImplementedError: on a big-endian machine (the format is little-endian).
    """
    if sys.byteorder != "little":
        raise NotImplementedError("oss_plus checkpoints are little-endian; this machine is not")
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def byte_chunks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yield the bytes of ``tensor`` (:func:`byte_view`) in pieces of at most CHUNK_BYTES."""
    flat = byte_view(tensor)
    step = CHUNK_BYTES
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


def crc32_of(tensor: torch.Tensor) -> int:
    """Return the CRC-32 (zlib) of the raw bytes of ``tensor``."""
    crc = 0
    for chunk in byte_chunks(tensor):
        crc = zlib.crc32(as_buffer(chunk), crc)
    return crc


def as_buffer(chunk: torch.Tensor) -> memoryview:
    """Return the bytes of a uint8 ``chunk`` (copied to the CPU only when it is elsewhere)."""
    return memoryview(chunk.cpu().numpy())  # type: ignore[arg-type]


class FileWriter:
    """Writes one safetensors file: the header, then raw bytes; fsynced by :meth:`finish`.

    :meth:`write` appends; :meth:`write_at` writes at an offset and may be called from
    several threads at once (positional writes). Writeback of every large piece is started
    at once (``posix_fadvise(DONTNEED)`` schedules dirty pages for writing without waiting
    and without dropping them), so the disk works while the next bytes are copied and the
    final fsync has little left to wait for.
    """

    def __init__(self, file: Path, header: bytes) -> None:
        self.file = file
        self._fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = 0
        self._pending = 0  # start of the bytes appended whose writeback was not started
        self.write(memoryview(header))

    def write(self, data: memoryview) -> None:
        """Append ``data``."""
        self.write_at(data, self._end, start_writeback=False)
        if self._end - self._pending >= CHUNK_BYTES:
            self._start_writeback(self._pending, self._end - self._pending)
            self._pending = self._end

    def write_at(self, data: memoryview, offset: int, start_writeback: bool = True) -> None:
        """Write ``data`` at byte ``offset`` (thread-safe with other ``write_at`` calls)."""
        view = data.cast("B") if data.format != "B" else data
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self._end = max(self._end, offset + len(view))
        if start_writeback and len(view) >= (1 << 20):
            self._start_writeback(offset, len(view))

    def _start_writeback(self, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def finish(self) -> int:
        """Fsync and close; return the file size."""
        os.fsync(self._fd)
        self.close()
        return self._end

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_writer(file: Path, header: bytes) -> FileWriter:
    """Create ``file`` and write ``header`` (the hook tests patch to inject write failures)."""
    return FileWriter(file, header)


def write_file(
    file: Path, entries: Entries, save_id: str, progress: Progress | None = None
) -> tuple[int, Entries]:
    """Write the tensors of ``entries`` to a new safetensors ``file``, streamed and fsynced.

    Args:
        file: the file to create.
        entries: per flat index, state key -> tensor, :class:`PlainValue` or
            :class:`NestedValue`.
        save_id: stored in the file's metadata.
        progress: called with ``(bytes written, bytes total)`` after every chunk.

    Returns:
        The file size, and ``entries`` with every tensor (nested ones too) replaced by its
        :class:`TensorRef`.
    """
    items = tensor_slots(entries)
    total = sum(t.numel() * t.element_size() for _, _, t in items)
    refs: dict[Slot, TensorRef] = {}
    writer = open_writer(file, file_header(items, save_id))
    try:
        done = 0
        with torch.profiler.record_function("oss_plus::checkpoint_write"):
            for slot, name, tensor in items:
                crc = 0
                for chunk in byte_chunks(tensor):
                    data = as_buffer(chunk)
                    crc = zlib.crc32(data, crc)
                    writer.write(data)
                    done += len(data)
                    if progress is not None:
                        progress(done, total)
                dtype = dtype_name(tensor.dtype, name)
                refs[slot] = TensorRef(file.name, name, dtype, tuple(tensor.shape), crc)
        size = writer.finish()
    finally:
        writer.close()
    return size, replace_slots(entries, refs)


# ----------------------------------------------------------------------------- staging
def check_target(path: Path) -> None:
    """Raise if ``path`` cannot become (or be replaced by) a checkpoint directory."""
    if not path.name:
        raise ValueError(f"{path} cannot be a checkpoint directory: choose a subdirectory")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"{path} exists and is not a directory: a checkpoint is a directory; choose "
            "another path"
        )
    index = path / INDEX_FILE
    if index.exists():
        try:
            ours = json.loads(index.read_text("utf-8")).get("format") == FORMAT_NAME
        except (ValueError, AttributeError, OSError):
            ours = False
        if not ours:
            raise ValueError(
                f"{index} exists and is not an oss_plus checkpoint index: refusing to replace it; "
                "choose another directory"
            )


def prepare_stage(path: Path, save_id: str) -> Path:
    """Check ``path``, remove stale temporary siblings, create and return the stage directory.

    The stage stays locked (:mod:`oss_plus.checkpoint.locks`) until it is committed or
    removed, so that a concurrent save to the same path from another process group does not
    sweep it away.
    """
    check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = stage_path(path, save_id)
    with locks.locked(path.parent):  # the sweep and the new stage's lock are one step
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            if stale != stage and locks.stale(stale):
                logger.info("removing %s, left by an interrupted save", stale)
                shutil.rmtree(stale, ignore_errors=True)
        stage.mkdir()
        locks.hold(stage)
    return stage


def remove_stage(path: Path, save_id: str) -> None:
    """Remove the stage directory of a failed save (best effort) and release its lock."""
    stage = stage_path(path, save_id)
    shutil.rmtree(stage, ignore_errors=True)
    locks.release(stage)


def _fsync_dir(directory: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(stage: Path, index: Index) -> None:
    """Write ``index.json`` into ``stage`` and fsync it."""
    text = index.dumps()
    with open(stage / INDEX_FILE, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def commit(stage: Path, path: Path, index: Index) -> list[str]:
    """Move the staged save into ``path``; the ``index.json`` replacement is the commit point.

    A failure before the commit leaves the previous checkpoint as it was. Runs under a lock on
    ``path`` (when the filesystem has one), so concurrent commits to one path from several
    process groups are serialised.

    Returns:
        The names of the data files this commit replaced, for :func:`remove_replaced`: with
        the lock, every data file in ``path`` that was there before (the replaced save's and
        orphans of interrupted ones); without it, only the files of the replaced index.
    """
    path.mkdir(parents=True, exist_ok=True)
    with locks.locked(path) as locked:
        replaced = _replaced_files(path, index, locked)
        moved = []
        try:
            for name in index.files:
                os.rename(stage / name, path / name)
                moved.append(path / name)
            _fsync_dir(path)
            os.replace(stage / INDEX_FILE, path / INDEX_FILE)
        except BaseException:
            for file in moved:
                file.unlink(missing_ok=True)
            raise
        _fsync_dir(path)
    shutil.rmtree(stage, ignore_errors=True)
    locks.release(stage)
    return replaced


def _replaced_files(path: Path, index: Index, locked: bool) -> list[str]:
    """The data files a commit of ``index`` to ``path`` replaces (see :func:`commit`)."""
    names: set[str] = set()
    try:
        previous = json.loads((path / INDEX_FILE).read_text("utf-8")).get("files", [])
        names.update(f["name"] for f in previous if DATA_FILE.match(f["name"]))
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass  # no previous index (a first save), or not readable: nothing it names
    if locked:  # no other commit is between its renames and its index: the rest are orphans
        try:
            names.update(f.name for f in path.iterdir() if DATA_FILE.match(f.name))
        except OSError as exc:
            logger.warning("could not list %s to remove a replaced checkpoint: %s", path, exc)
    return sorted(names - set(index.files))


def remove_replaced(path: Path, names: list[str], rank: int = 0, world_size: int = 1) -> None:
    """Delete the data files ``names`` that a commit to ``path`` replaced (best effort).

    With several ranks, each deletes the files assigned to it by a hash of their name (the
    same on every rank), so large files are unlinked in parallel.
    """
    for name in names:
        if zlib.crc32(name.encode()) % world_size != rank:
            continue
        try:
            (path / name).unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not remove %s of a replaced checkpoint: %s", path / name, exc)
