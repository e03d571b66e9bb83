"""The collectives of a save, without pickle: metadata as JSON, tensors streamed to rank 0.

Metadata travels as UTF-8 JSON in uint8 tensors (:func:`gather_json`). In the consolidated
layout each sender's state tensors form one stream, in file order. Both ends cut it into the
same messages (:func:`oss_plus.runtime.dist.message_plan`): tensors smaller than
:data:`ALONE_BYTES` are packed together up to ``CHUNK_BYTES`` (one copy into a packing
buffer), larger ones travel alone in chunks of at most ``CHUNK_BYTES`` (views of their
memory, no copy). So thousands of small params make a few messages. Senders checksum.

Group rank 0 receives the streams one sender after the other with two receives posted ahead,
and writes every piece at its offset in the file, while a thread writes rank 0's own tensors.
No rank holds more than two buffers of ``CHUNK_BYTES`` beyond its own state.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.checkpoint import storage
from oss_plus.runtime.dist import (
    Piece,
    await_release,
    comm_device,
    global_rank,
    message_plan,
    pad_bytes,
    released,
    use_counts,
)

__all__ = [
    "ALONE_BYTES",
    "barrier",
    "broadcast_json",
    "broadcast_text",
    "gather_json",
    "receive_to_file",
    "send_tensors",
]

#: Tensors at least this large travel alone (in chunks); smaller ones are packed together.
ALONE_BYTES = 1 << 20


def _messages(sizes: Sequence[int]) -> list[list[Piece]]:
    """The stream's messages (module constants read at call time, so tests can shrink them)."""
    return message_plan(
        sizes,
        pack_bytes=storage.CHUNK_BYTES,
        alone_bytes=ALONE_BYTES,
        chunk_bytes=storage.CHUNK_BYTES,
    )


# ----------------------------------------------------------------------------- metadata
def gather_json(obj: Any, group: Any) -> list[Any] | None:
    """Gather the JSON-serialisable ``obj`` of every rank on group rank 0 (collective).

    Returns:
        The objects by rank on group rank 0, None elsewhere.

    .. warning:: Collective: call on every rank of ``group``.
    """
    mine, sizes = pad_bytes(json.dumps(obj, allow_nan=False).encode(), group)
    gathered = [torch.empty_like(mine) for _ in sizes] if dist.get_rank(group) == 0 else None
    with released(group, mine, *(gathered or [])):
        dist.gather(mine, gathered, dst=global_rank(group, 0), group=group)
    if gathered is None:
        return None
    return [json.loads(bytes(t[:n].cpu().numpy())) for t, n in zip(gathered, sizes)]


def barrier(group: Any) -> None:
    """Wait until every rank of ``group`` got here (one tiny all_reduce; collective)."""
    token = torch.zeros(1, dtype=torch.int32, device=comm_device(group))
    with released(group, token):
        dist.all_reduce(token, group=group)


def broadcast_text(text: str | None, length: int, group: Any) -> str:
    """Broadcast the ASCII ``text`` (exactly ``length`` characters) from group rank 0.

    .. warning:: Collective: call on every rank of ``group``.
    """
    device = comm_device(group)
    buffer = torch.zeros(length, dtype=torch.uint8, device=device)
    if dist.get_rank(group) == 0:
        assert text is not None and len(text) == length
        buffer.copy_(torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8))
    with released(group, buffer):
        dist.broadcast(buffer, src=global_rank(group, 0), group=group)
    return bytes(buffer.cpu().numpy()).decode("ascii")


def broadcast_json(obj: Any, group: Any) -> Any:
    """Broadcast the JSON-serialisable ``obj`` of group rank 0 (two small broadcasts).

    .. warning:: Collective: call on every rank of ``group``.
    """
    device = comm_device(group)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    data = json.dumps(obj, allow_nan=False).encode() if dist.get_rank(group) == 0 else b""
    length.fill_(len(data))
    with released(group, length):
        dist.broadcast(length, src=global_rank(group, 0), group=group)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    with released(group, buffer):
        dist.broadcast(buffer, src=global_rank(group, 0), group=group)
    return json.loads(bytes(buffer.cpu().numpy()))


# ----------------------------------------------------------------------------- tensor data
def send_tensors(tensors: Sequence[torch.Tensor], group: Any) -> tuple[list[int], Exception | None]:
    """Send the bytes of ``tensors`` to group rank 0 as :func:`_messages` cuts them.

    A failure while preparing the bytes does not break the protocol: zeros are sent in place
    of the missing bytes and the error is returned, for ``_dist.agree``.

    Returns:
        The CRC-32 of every tensor, and the first error (or None).

    .. warning:: Collective with :func:`receive_to_file` on group rank 0.
    """
    device, dst = comm_device(group), global_rank(group, 0)
    crcs = [0] * len(tensors)
    views: dict[int, torch.Tensor] = {}
    pack: torch.Tensor | None = None
    error: Exception | None = None
    with torch.profiler.record_function("oss_plus::checkpoint_send"):
        for message in _messages([t.numel() * t.element_size() for t in tensors]):
            if pack is None and len(message) > 1:
                pack = torch.empty(storage.CHUNK_BYTES, dtype=torch.uint8)
            buffer = None
            if error is None:
                try:
                    buffer = _message(tensors, views, message, crcs, pack)
                except Exception as exc:  # noqa: BLE001 - reported by _dist.agree
                    error = exc
            if buffer is None:  # keep the protocol: zeros in place of the missing bytes
                if pack is None:
                    pack = torch.empty(storage.CHUNK_BYTES, dtype=torch.uint8)
                buffer = pack[: sum(n for _, _, n in message)].zero_()
            buffer = buffer.to(device)
            with released(group, buffer):
                work = dist.isend(buffer, dst=dst, group=group)
                if work is not None:
                    work.wait()
                del work
    return crcs, error


def _message(
    tensors: Sequence[torch.Tensor],
    views: dict[int, torch.Tensor],
    message: list[Piece],
    crcs: list[int],
    pack: torch.Tensor | None,
) -> torch.Tensor:
    """Return the bytes of one message (a view, or packed into ``pack``); update ``crcs``."""
    parts = []
    for i, start, n in message:
        if i not in views:
            views[i] = storage.byte_view(tensors[i])
        part = views[i][start : start + n]
        crcs[i] = zlib.crc32(storage.as_buffer(part), crcs[i])
        parts.append(part)
        if start + n == views[i].numel():
            del views[i]
    if len(parts) == 1:
        return parts[0]
    assert pack is not None
    at = 0
    for part in parts:
        pack[at : at + part.numel()].copy_(part)
        at += part.numel()
    return pack[:at]


def receive_to_file(
    items: Sequence[tuple[int, Any, int]], writer: Any, offset: int, group: Any
) -> tuple[dict[int, int], Exception | None]:
    """On group rank 0: write every item's bytes at its place in the file.

    Args:
        items: ``(owner rank, local tensor or None, nbytes)`` in file order.
        writer: the open :class:`oss_plus.checkpoint.storage.FileWriter`, or None if opening failed
            (the bytes are still received, so the senders never block).
        offset: where the first item starts in the file (the header's length).
        group: the process group.

    Returns:
        The CRC-32 of every local item by position (the senders checksum theirs), and the
        first error (or None).

    .. warning:: Collective with :func:`send_tensors` on the other ranks.
    """
    starts, position = [], offset
    for _, _, nbytes in items:
        starts.append(position)
        position += nbytes
    local = _LocalWriter(
        [(pos, item[1], starts[pos]) for pos, item in enumerate(items) if item[0] == 0], writer
    )
    schedule = _schedule(items)
    receiver = _Prefetcher(schedule, group)
    error: Exception | None = None
    with torch.profiler.record_function("oss_plus::checkpoint_receive"):
        local.start()
        for k, (_, _, pieces) in enumerate(schedule):
            buffer = receiver.take(k)
            if writer is not None and error is None:
                try:
                    at = 0
                    for pos, start, n in pieces:
                        writer.write_at(storage.as_buffer(buffer[at : at + n]), starts[pos] + start)
                        at += n
                except Exception as exc:  # noqa: BLE001 - keep receiving, report later
                    error = exc
            receiver.post()  # the buffer of message k is free again
        local.join()
    return local.crcs, error or local.error


def _schedule(items: Sequence[tuple[int, Any, int]]) -> list[tuple[int, int, list[Piece]]]:
    """Every remote message, sender after sender: (owner, bytes, pieces by file position)."""
    schedule = []
    for owner in sorted({item[0] for item in items} - {0}):
        positions = [pos for pos, item in enumerate(items) if item[0] == owner]
        for message in _messages([items[pos][2] for pos in positions]):
            pieces = [(positions[i], start, n) for i, start, n in message]
            schedule.append((owner, sum(n for _, _, n in message), pieces))
    return schedule


class _LocalWriter(threading.Thread):
    """Writes (and checksums) rank 0's own items at their offsets, in a thread."""

    def __init__(self, items: list[tuple[int, torch.Tensor, int]], writer: Any) -> None:
        super().__init__(name="oss_plus-checkpoint-writer", daemon=True)
        self._items, self._writer = items, writer
        self.crcs: dict[int, int] = {}
        self.error: Exception | None = None

    def run(self) -> None:
        if self._writer is None:
            return
        try:
            for pos, tensor, start in self._items:
                crc = 0
                for chunk in storage.byte_chunks(tensor):
                    data = storage.as_buffer(chunk)
                    crc = zlib.crc32(data, crc)
                    self._writer.write_at(data, start)
                    start += len(data)
                self.crcs[pos] = crc
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc


class _Prefetcher:
    """Posts the receives of a schedule of messages, at most two ahead, in order."""

    def __init__(self, schedule: Sequence[tuple[int, int, list[Piece]]], group: Any) -> None:
        self._schedule, self._group = schedule, group
        device = comm_device(group)
        self._buffers = [
            torch.empty(storage.CHUNK_BYTES, dtype=torch.uint8, device=device)
            for _ in range(min(2, len(schedule)))
        ]
        self._posted: dict[int, tuple[Any, torch.Tensor, list[int]]] = {}
        self._next = 0
        self.post()

    def post(self) -> None:
        while self._next < len(self._schedule) and len(self._posted) < len(self._buffers):
            owner, size, _ = self._schedule[self._next]
            view = self._buffers[self._next % len(self._buffers)][:size]
            counts = use_counts([view])
            work = dist.irecv(view, src=global_rank(self._group, owner), group=self._group)
            self._posted[self._next] = (work, view, counts)
            self._next += 1

    def take(self, k: int) -> torch.Tensor:
        """Wait for message ``k``; return its bytes once the transport let go of them."""
        work, view, counts = self._posted.pop(k)
        work.wait()
        del work
        await_release([view], counts, self._group)
        return view
