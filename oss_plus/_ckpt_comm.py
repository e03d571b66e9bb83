"""The small collectives a checkpoint save/load needs, without pickle.

Metadata travels as UTF-8 JSON in uint8 tensors; errors travel as text so that every rank
raises a message naming the file and the mismatch. (The consolidated save's tensor data
path is :mod:`oss_plus._ckpt_stream`.) Every function takes the process group explicitly and
addresses peers by group-local rank.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._dist import PEER_FAILED, any_rank, comm_device, global_rank

__all__ = [
    "barrier",
    "broadcast_text",
    "gather_json",
    "raise_everywhere",
]

logger = logging.getLogger(__name__)

#: Exception types re-raised with the same type on the ranks that did not fail themselves.
_SHARED_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        FileNotFoundError,
        NotADirectoryError,
        PermissionError,
        NotImplementedError,
        OSError,
    )
}


def _padded(data: bytes, group: Any) -> tuple[torch.Tensor, list[int]]:
    """Return ``data`` as uint8 padded to the longest of the group's, and every length."""
    device = comm_device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded, sizes


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Return the ``data`` of every rank of ``group`` (collective)."""
    mine, sizes = _padded(data, group)
    everyone = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(everyone, mine, group=group)
    return [bytes(t[:n].cpu().numpy()) for t, n in zip(everyone, sizes)]


def gather_json(obj: Any, group: Any) -> list[Any] | None:
    """Gather the JSON-serialisable ``obj`` of every rank on group rank 0 (collective).

    Returns:
        The objects by rank on group rank 0, None elsewhere.
    """
    mine, sizes = _padded(json.dumps(obj, allow_nan=False).encode(), group)
    gathered = [torch.empty_like(mine) for _ in sizes] if dist.get_rank(group) == 0 else None
    dist.gather(mine, gathered, dst=global_rank(group, 0), group=group)
    if gathered is None:
        return None
    return [json.loads(bytes(t[:n].cpu().numpy())) for t, n in zip(gathered, sizes)]


def barrier(group: Any) -> None:
    """Wait until every rank of ``group`` got here (one tiny all_reduce; collective)."""
    dist.all_reduce(torch.zeros(1, dtype=torch.int32, device=comm_device(group)), group=group)


def broadcast_text(text: str | None, length: int, group: Any) -> str:
    """Broadcast the ASCII ``text`` (exactly ``length`` characters) from group rank 0."""
    device = comm_device(group)
    buffer = torch.zeros(length, dtype=torch.uint8, device=device)
    if dist.get_rank(group) == 0:
        assert text is not None and len(text) == length
        buffer.copy_(torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8))
    dist.broadcast(buffer, src=global_rank(group, 0), group=group)
    return bytes(buffer.cpu().numpy()).decode("ascii")


def raise_everywhere(
    error: BaseException | None, group: Any, cleanup: Callable[[], None] | None = None
) -> None:
    """Raise on every rank of ``group`` if any rank has an ``error`` (collective).

    The rank that failed re-raises its own error; the others raise an error of the same
    type (for the common types) whose message carries the failed rank's message, so every
    rank names the file and the mismatch. ``cleanup`` runs first on every rank when any
    rank failed. Nothing travels but flags and text.
    """
    failed = [r for r, flag in enumerate(any_rank(error is not None, group)) if flag]
    if not failed:
        return
    if cleanup is not None:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the original error matters more
            logger.warning("cleanup after a failed checkpoint operation failed", exc_info=True)
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    messages = all_gather_bytes(text.encode("utf-8", "replace"), group)
    if error is not None:
        raise error
    kind, _, message = messages[failed[0]].decode("utf-8", "replace").partition(": ")
    cls = _SHARED_ERRORS.get(kind, RuntimeError)
    raise cls(f"{PEER_FAILED.format(ranks=failed)}; rank {failed[0]} raised {kind}: {message}")
