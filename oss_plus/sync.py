"""Parameter synchronisation after the local step: flat buckets, broadcasts, wire compression.

Layout (fairscale's): for every (device, dtype, owner rank) there is one flat buffer holding
that owner's *trainable* parameters in ascending element count, each starting at an aligned
offset (see :func:`alignment`); each parameter's ``.data`` is a view into its buffer, so the owner's update lands in the buffer with no copy and one
broadcast per buffer brings every replica up to date. Frozen parameters are never sent.

Compression: when a wire dtype narrower than a bucket's dtype is requested (fp16/bf16), the
owner copies its buffer into a preallocated wire buffer and broadcasts that; receivers widen it
into their buffer. The owner's own values are never rounded, so updates smaller than the
wire format's resolution still accumulate on the owner. Replicas hold the owner's values
rounded to the wire dtype until the next step.

Buffers are allocated when the layout is built (construction, ``add_param_group``,
``refresh_trainable``); a step allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._dist import global_rank

__all__ = ["Bucket", "BucketSync", "wire_dtype_for"]

#: Floating dtypes that may travel compressed, and the wire dtypes allowed.
WIRE_DTYPES = (torch.float16, torch.bfloat16)


def wire_dtype_for(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype | None:
    """Return the dtype a buffer of ``dtype`` travels as, or None when it goes uncompressed.

    Only floating dtypes wider than ``wire`` are compressed: bf16/fp16 params are never
    upcast, integer params are never touched.

    Example:
        >>> wire_dtype_for(torch.float32, torch.bfloat16)
        torch.bfloat16
        >>> wire_dtype_for(torch.bfloat16, torch.float16) is None
        True
    """
    if wire is None or not dtype.is_floating_point or dtype.itemsize <= wire.itemsize:
        return None
    return wire


@dataclass
class Bucket:
    """One flat buffer: the trainable params of ``owner`` with one device and dtype."""

    owner: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    wire: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def wire_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the preallocated compressed copy for ``dtype`` (allocated on first use)."""
        if dtype not in self.wire:
            self.wire[dtype] = torch.empty(self.buffer.numel(), dtype=dtype, device=self.buffer.device)
        return self.wire[dtype]


def alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Return the element alignment of a param inside a bucket.

    Each param starts where a standalone tensor would (64 bytes on CPU, 512 on accelerators,
    as torch's allocators align), so kernels take the same code paths and fp32 results stay
    bit-identical to the unsharded model's.
    """
    nbytes = 64 if device.type == "cpu" else 512
    return max(1, nbytes // dtype.itemsize)


def _padded(numel: int, align: int) -> int:
    return -(-numel // align) * align


def _bucket_key(p: torch.Tensor) -> tuple[str, torch.dtype]:
    return (str(p.device), p.dtype)


class BucketSync:
    """Flat per-owner buckets whose views are the parameters; one broadcast per bucket.

    Args:
        params_by_owner: for every group-local rank, the params it owns (any order; frozen
            ones are skipped, the rest are laid out in ascending element count, stable).
        group: the process group.
        aligned: start every param at an allocator-aligned offset (default). fairscale packs
            params back to back; its compatibility layer passes False to match it.
    """

    def __init__(
        self, params_by_owner: Sequence[Sequence[torch.Tensor]], group: Any, aligned: bool = True
    ) -> None:
        self.group = group
        self.aligned = aligned
        self.rank = dist.get_rank(group)
        self.buckets: list[Bucket] = []
        for owner, params in enumerate(params_by_owner):
            trainable = sorted((p for p in params if p.requires_grad), key=lambda p: p.numel())
            by_key: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
            for p in trainable:
                by_key.setdefault(_bucket_key(p), []).append(p)
            for members in by_key.values():
                self.buckets.append(self._make_bucket(owner, members, aligned))
        self._ptrs = self._current_ptrs()

    @staticmethod
    @torch.no_grad()
    def _make_bucket(owner: int, params: list[torch.Tensor], aligned: bool) -> Bucket:
        align = alignment(params[0].device, params[0].dtype) if aligned else 1
        total = sum(_padded(p.numel(), align) for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            view = buffer[offset : offset + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            offset += _padded(p.numel(), align)
        return Bucket(owner, buffer, list(params))

    def _current_ptrs(self) -> list[int]:
        return [p.data_ptr() for b in self.buckets for p in b.params]

    def is_intact(self) -> bool:
        """Return False when a param stopped being a view of its bucket (``.data`` replaced,
        ``module.to(...)``): the layout must then be rebuilt."""
        return self._current_ptrs() == self._ptrs

    @torch.no_grad()
    def release(self) -> None:
        """Give every bucketed param its own storage again (before a layout is dropped)."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.data = p.data.clone()
        self.buckets = []
        self._ptrs = []

    def wire_bytes(self, wire: torch.dtype | None = None) -> int:
        """Return the bytes one :meth:`sync` moves: every bucket once (alignment padding
        included), whether this rank sends or receives it."""
        total = 0
        for b in self.buckets:
            dtype = wire_dtype_for(b.buffer.dtype, wire) or b.buffer.dtype
            total += b.buffer.numel() * dtype.itemsize
        return total

    @torch.no_grad()
    def sync(self, wire: torch.dtype | None = None) -> None:
        """Broadcast every bucket from its owner; compress with ``wire`` where it narrows.

        .. warning:: Collective: call on every rank of ``group``.
        """
        with torch.profiler.record_function("oss_plus::sync"):
            pending = []
            for bucket in self.buckets:
                dtype = wire_dtype_for(bucket.buffer.dtype, wire)
                tensor = bucket.buffer if dtype is None else bucket.wire_buffer(dtype)
                if dtype is not None and bucket.owner == self.rank:
                    tensor.copy_(bucket.buffer)
                src = global_rank(self.group, bucket.owner)
                work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
                pending.append((work, bucket, tensor, dtype))
            for work, bucket, tensor, dtype in pending:
                work.wait()
                if dtype is not None and bucket.owner != self.rank:
                    bucket.buffer.copy_(tensor)
