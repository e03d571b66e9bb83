"""The small collectives a checkpoint save/load needs, without pickle.

Metadata travels as UTF-8 JSON in uint8 tensors; errors travel as text so that every rank
raises a message naming the file and the mismatch. (The consolidated save's tensor data
path is :mod:`oss_plus._ckpt_stream`.) Every function takes the process group explicitly and
addresses peers by group-local rank.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._dist import comm_device, global_rank, pad_bytes

__all__ = [
    "barrier",
    "broadcast_text",
    "gather_json",
]

logger = logging.getLogger(__name__)


def gather_json(obj: Any, group: Any) -> list[Any] | None:
    """Gather the JSON-serialisable ``obj`` of every rank on group rank 0 (collective).

    Returns:
        The objects by rank on group rank 0, None elsewhere.
    """
    mine, sizes = pad_bytes(json.dumps(obj, allow_nan=False).encode(), group)
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
