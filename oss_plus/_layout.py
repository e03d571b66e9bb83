"""Bucket layout for the parameter sync (no collectives): which params share a flat buffer,
where each one starts, and how a buffer's views replace the params' storage.

For every (device, dtype, owner rank) one flat buffer holds that owner's *trainable* params in
ascending element count (stable), each starting at an allocator-aligned offset; each param's
``.data`` becomes a view into it (with a storage object of its own, :func:`own_storage`), so
the owner's update lands in the buffer with no copy.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "Bucket",
    "Gather",
    "Transport",
    "alignment",
    "bucket_numel",
    "lay_out",
    "own_storage",
    "plan",
]

Key = tuple[str, torch.dtype]
Plan = list[tuple[int, Key, list[torch.Tensor]]]


class Transport(str, enum.Enum):
    """How buckets travel from their owner to the other ranks (see :mod:`oss_plus.sync`)."""

    AUTO = "auto"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"


@dataclass
class Bucket:
    """One flat buffer: the trainable params of ``owner`` with one device and dtype.

    ``via`` is the transport of this bucket.
    """

    owner: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    wire: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    via: Transport = Transport.BROADCAST

    def wire_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the preallocated compressed copy for ``dtype`` (allocated on first use)."""
        if dtype not in self.wire:
            self.wire[dtype] = torch.empty(
                self.buffer.numel(), dtype=dtype, device=self.buffer.device
            )
        return self.wire[dtype]


@dataclass
class Gather:
    """The ``all_gather`` layout of one (device, dtype): ``region`` elements per rank."""

    flat: torch.Tensor
    region: int
    wire: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def wire_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the preallocated compressed copy of ``flat`` (allocated on first use)."""
        if dtype not in self.wire:
            self.wire[dtype] = torch.empty(self.flat.numel(), dtype=dtype, device=self.flat.device)
        return self.wire[dtype]


def alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Return the element alignment of a param inside a bucket.

    Each param starts where a standalone tensor would (64 bytes on CPU, 512 on accelerators,
    as torch's allocators align), so kernels take the same code paths and fp32 results stay
    bit-identical to the unsharded model's.
    """
    nbytes = 64 if device.type == "cpu" else 512
    return max(1, nbytes // dtype.itemsize)


def padded(numel: int, align: int) -> int:
    """Round ``numel`` up to a multiple of ``align``."""
    return -(-numel // align) * align


def bucket_numel(params: Sequence[torch.Tensor], aligned: bool) -> int:
    """Return the elements of a bucket holding ``params`` (alignment padding included)."""
    if not params:
        return 0
    align = alignment(params[0].device, params[0].dtype) if aligned else 1
    return sum(padded(p.numel(), align) for p in params)


def plan(params_by_owner: Sequence[Sequence[torch.Tensor]]) -> Plan:
    """Return (owner, key, members) per bucket: trainable params by ascending size (stable)."""
    buckets: Plan = []
    for owner, params in enumerate(params_by_owner):
        by_key: dict[Key, list[torch.Tensor]] = {}
        for p in sorted((p for p in params if p.requires_grad), key=lambda p: p.numel()):
            by_key.setdefault((str(p.device), p.dtype), []).append(p)
        buckets.extend((owner, key, members) for key, members in by_key.items())
    return buckets


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """Return a tensor over the memory of ``view`` whose storage object is its own.

    safetensors, Accelerate and transformers group tensors by storage to find tied weights:
    params that are views of one bucket would be refused (``save_model``) or dropped
    (``save_state``). A DLPack round trip wraps the same memory in a new storage that starts
    at the view's first element and keeps the bucket alive, so every param looks like a
    standalone tensor while the bucket's collectives still update it in place. Done once per
    layout, never per step. Falls back to the plain view where DLPack cannot export the dtype.
    """
    try:
        return torch.from_dlpack(view.detach())
    except (BufferError, RuntimeError, TypeError):
        return view


@torch.no_grad()
def lay_out(
    owner: int,
    params: list[torch.Tensor],
    aligned: bool,
    buffer: torch.Tensor | None = None,
    copy: bool = True,
) -> Bucket:
    """Make ``params`` views into ``buffer`` (a new zeroed one by default).

    Args:
        owner: the group-local rank that updates these params.
        params: the members, in layout order.
        aligned: start each at an allocator-aligned offset (else back to back).
        buffer: where to lay them out; at least :func:`bucket_numel` elements.
        copy: copy the params' current values in (False: the buffer already holds them).
    """
    align = alignment(params[0].device, params[0].dtype) if aligned else 1
    if buffer is None:
        buffer = torch.zeros(
            bucket_numel(params, aligned), dtype=params[0].dtype, device=params[0].device
        )
    offset = 0
    for p in params:
        view = buffer[offset : offset + p.numel()].view_as(p)
        if copy:
            view.copy_(p.data)
        p.data = own_storage(view)
        offset += padded(p.numel(), align)
    return Bucket(owner, buffer, list(params))
