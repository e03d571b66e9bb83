"""The gradient buckets of a reduce plan: their storage and the collectives that send them.

Storage. A bucket this rank owns (uncompressed, contiguous members) has a *persistent* flat
buffer, allocated once; its params' ``.grad`` are views of it, like DDP's
``gradient_as_bucket_view``, so a gradient accumulated into ``.grad`` lands in the bucket
and nothing is copied. Other buckets are *transient*: allocated when their first gradient
arrives (:meth:`Buckets.staged`), released when their collective completes.

Collectives (:func:`~oss_plus.data_parallel.plan.launch_groups`):

* ``"reduce"``: one ``dist.reduce`` of each bucket to its owner;
* ``"reduce_scatter"``: consecutive buckets with distinct owners go in one
  ``reduce_scatter_tensor`` whose input holds rank ``r``'s bucket in segment ``r`` (each
  segment padded to the group's largest bucket). Transient buckets are views of that input;
  a persistent bucket is copied into its segment at launch and receives the sum in place.

A *split bucket* (a param the flat partition rule cut into pieces) is transient on every
rank; at launch each piece's slice is sent with one ``dist.reduce`` to the piece's owner (on
every backend: the pieces are of unequal size), and a rank holding a piece keeps the sum in
its range (:meth:`Buckets.results`; the reducer zeroes the rest).

Groups launch strictly in plan order, each when all its buckets are full, so every rank
issues the same collectives in the same order. At launch the buffer is scaled by
``1 / world_size`` (DDP's ``mul_out``; compressed: divided in the wire dtype, as DDP's
compress hooks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus import _dist
from oss_plus.data_parallel.compress import buffer_dtype
from oss_plus.data_parallel.plan import ReducePlan, launch_groups

__all__ = ["COLLECTIVES", "Buckets", "pick_collective"]

#: The collectives a bucket can travel with.
COLLECTIVES = ("reduce", "reduce_scatter")

_unflatten = torch._C._nn.unflatten_dense_tensors


def pick_collective(requested: str, group: Any) -> str:
    """``requested``, or for ``"auto"`` the faster one on ``group``'s backend.

    gloo: ``reduce`` (measured faster than ``reduce_scatter_tensor``, docs/zero2.md); NCCL:
    ``reduce_scatter`` (NCCL's most optimized reduction; unverified here, no GPU).

    Raises:
        ValueError: ``requested`` is not "auto" or one of :data:`COLLECTIVES`.
    """
    if requested == "auto":
        return "reduce_scatter" if dist.get_backend(group) == dist.Backend.NCCL else "reduce"
    if requested not in COLLECTIVES:
        raise ValueError(
            f"collective must be 'auto', 'reduce' or 'reduce_scatter', got {requested!r}"
        )
    return requested


class Buckets:
    """Storage and collectives of one plan's buckets (see module doc).

    Args:
        params: the trainable params, indexed like the plan's specs.
        plan: the buckets.
        group: the process group.
        wire: the wire dtype (None: no compression).
        collective: ``"reduce"`` or ``"reduce_scatter"``.

    .. warning:: Collective: every rank of ``group`` must fill the same buckets.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        plan: ReducePlan,
        group: Any,
        wire: torch.dtype | None,
        collective: str,
    ) -> None:
        self.plan, self.group = plan, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        buckets = plan.buckets
        self.members = [[params[i] for i in b.members] for b in buckets]
        self.owned = [b.holds(self.rank) for b in buckets]
        self._split = [bool(b.pieces) for b in buckets]
        self._dst = [_dist.global_rank(group, b.owner) if b.owner >= 0 else -1 for b in buckets]
        self._dtype = [buffer_dtype(m[0].dtype, wire) for m in self.members]
        self._compressed = [d != m[0].dtype for d, m in zip(self._dtype, self.members)]
        self._scatter = collective == "reduce_scatter"
        keys = [(d, m[0].device) for d, m in zip(self._dtype, self.members)]
        self.groups = launch_groups(plan, self._scatter, keys)
        self._group_of = [0] * len(buckets)
        for g, launch in enumerate(self.groups):
            for b in launch.buckets:
                self._group_of[b] = g
        #: Persistent buckets: the flat buffer and the views that are their params' grads.
        self.flats: list[torch.Tensor | None] = [None] * len(buckets)
        self.views: list[list[torch.Tensor] | None] = [None] * len(buckets)
        self._allocate_persistent()
        self.reset()

    @torch.no_grad()
    def _allocate_persistent(self) -> None:
        for b, bucket in enumerate(self.plan.buckets):
            members = self.members[b]
            if not self.owned[b] or self._compressed[b] or self._split[b]:
                continue
            if not all(p.is_contiguous() for p in members):
                continue  # a view could not honour the param's strides: copy instead
            size = self.groups[self._group_of[b]].segment if self._scatter else bucket.numel
            flat = torch.zeros(size, dtype=self._dtype[b], device=members[0].device)
            self.flats[b] = flat
            self.views[b] = list(_unflatten(flat[: bucket.numel], members))

    def reset(self) -> None:
        """Forget the transient buffers and the launch state (a new reduction starts)."""
        #: Transient buckets open now: views shaped like their members (None: not open).
        self.open: list[list[torch.Tensor] | None] = [None] * len(self.plan.buckets)
        self._buffers: list[torch.Tensor | None] = [None] * len(self.plan.buckets)
        self._inputs: list[torch.Tensor | None] = [None] * len(self.groups)
        self._left = [len(g.buckets) for g in self.groups]
        self.next = 0  # the next group to launch
        self._works: deque[tuple[int, Any, torch.Tensor | None]] = deque()
        #: Owned transient buckets whose sums arrived: (bucket, views shaped like members).
        self.results: list[tuple[int, list[torch.Tensor]]] = []

    # ----------------------------------------------------------------- filling
    def staged(self, b: int) -> list[torch.Tensor]:
        """Views (shaped like the members) of transient bucket ``b``, allocated on demand."""
        staged = self.open[b]
        if staged is None:
            flat = self._buffers[b] = self._segment(b)
            staged = self.open[b] = list(_unflatten(flat, self.members[b]))
        return staged

    def _segment(self, b: int) -> torch.Tensor:
        """The flat storage of bucket ``b``: its own buffer, or its segment of the input."""
        numel, device = self.plan.buckets[b].numel, self.members[b][0].device
        if not self._scatter or self._split[b]:
            return torch.empty(numel, dtype=self._dtype[b], device=device)
        start = self.plan.buckets[b].owner * self.groups[self._group_of[b]].segment
        return self._input(self._group_of[b])[start : start + numel]

    def _input(self, g: int) -> torch.Tensor:
        flat = self._inputs[g]
        if flat is None:
            b = self.groups[g].buckets[0]
            size = self.world_size * self.groups[g].segment
            flat = torch.empty(size, dtype=self._dtype[b], device=self.members[b][0].device)
            self._inputs[g] = flat
        return flat

    def bucket_full(self, b: int) -> None:
        """Bucket ``b`` holds all its gradients: launch every group that is ready, in order."""
        g = self._group_of[b]
        self._left[g] -= 1
        if g == self.next and self._left[g] == 0:
            self.launch_ready()

    def launch_ready(self) -> None:
        """Launch the groups, in order, up to the first one that is not full."""
        left, count = self._left, len(self._left)
        while self.next < count and left[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def mark_all_full(self) -> None:
        """End of backward: every bucket is complete now (missing gradients were filled)."""
        self._left = [0] * len(self._left)

    # ----------------------------------------------------------------- sending
    @torch.no_grad()
    def _launch(self, g: int) -> None:
        first = self.groups[g].buckets[0]
        if self._scatter and not self._split[first]:
            flat, target, out = self._scatter_buffers(g)
        else:
            if self.flats[first] is None:
                self.staged(first)
            buffer = self.flats[first] if self.flats[first] is not None else self._buffers[first]
            assert buffer is not None
            flat = target = buffer
            out = None
        if self._compressed[first]:
            flat.div_(self.world_size)
        else:
            flat.mul_(1.0 / self.world_size)
        with torch.profiler.record_function("oss_plus::sdp::reduce_bucket"):
            if self._split[first]:
                work = _AllOf(
                    [
                        dist.reduce(
                            flat[start:end],
                            dst=_dist.global_rank(self.group, owner),
                            group=self.group,
                            async_op=True,
                        )
                        for start, end, owner in self.plan.buckets[first].pieces
                    ]
                )
            elif self._scatter:
                work = dist.reduce_scatter_tensor(target, flat, group=self.group, async_op=True)
            else:
                work = dist.reduce(flat, dst=self._dst[first], group=self.group, async_op=True)
        self._works.append((g, work, out))
        while self._works and self._works[0][1].is_completed():
            self.complete_oldest()  # release finished transient buffers early

    def _mine(self, g: int) -> int | None:
        for b in self.groups[g].buckets:
            if self.owned[b]:
                return b
        return None

    def _scatter_buffers(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The group's input (this rank's persistent bucket copied in), the output, and the
        output again when it is transient (None when it is the persistent bucket)."""
        flat, segment = self._input(g), self.groups[g].segment
        mine = self._mine(g)
        own = self.flats[mine] if mine is not None else None
        if own is not None:
            numel = self.plan.buckets[mine].numel  # type: ignore[index]
            flat[self.rank * segment : self.rank * segment + numel].copy_(own[:numel])
            return flat, own, None
        out = torch.empty(segment, dtype=flat.dtype, device=flat.device)
        return flat, out, out

    # ----------------------------------------------------------------- completion
    def complete_oldest(self) -> None:
        """Wait for the oldest collective; release its transient buffers; queue results."""
        g, work, out = self._works.popleft()
        work.wait()
        for b in self.groups[g].buckets:
            staged = self.open[b]
            self.open[b] = self._buffers[b] = None
            if not self.owned[b] or self.flats[b] is not None:
                continue  # not ours, or persistent: the grads (views) hold the sums already
            if out is not None:  # reduce_scatter: the sum is in the output, not the input
                numel = self.plan.buckets[b].numel
                staged = list(_unflatten(out[:numel], self.members[b]))
            assert staged is not None
            self.results.append((b, staged))
        self._inputs[g] = None

    def complete_all(self) -> None:
        """Wait for every collective in flight."""
        while self._works:
            self.complete_oldest()


class _AllOf:
    """The works of a split bucket's per-piece reduces, waited for as one."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
