"""The gradient buckets of a reduce plan: their storage and the collectives that send them.

Storage. A bucket this rank owns (uncompressed, contiguous members) has a *persistent* flat
buffer, allocated once; its params' ``.grad`` are views of it (DDP's ``gradient_as_bucket_view``:
nothing is copied). Other buckets are *transient*: allocated when their first gradient arrives
(:meth:`Buckets.staged`), released when their collective completes.

Collectives (:func:`~oss_plus.data_parallel.plan.launch_groups`):

* ``"reduce"``: one ``dist.reduce`` of each bucket to its owner;
* ``"reduce_scatter"``: consecutive buckets with distinct owners go in one
  ``reduce_scatter_tensor`` whose input holds rank ``r``'s bucket in segment ``r`` (each
  segment padded to the group's largest bucket). Transient buckets are views of that input;
  a persistent bucket is copied into its segment at launch and receives the sum in place.

A flat key's bucket (an optimizer with ``partition_rule="flat"``,
:mod:`oss_plus.data_parallel.flat`) is a slice of one rank's range of the key's gradient
buffer. Its owner keeps one persistent buffer per key over its range (allocated once): the
bucket, the ``.grad`` of the whole params inside it and the piece of a param cut by a range
boundary (handed to the optimizer) are views of it. Other ranks stage the slice in a transient
buffer (zeroed between params). Each such bucket travels alone, one ``dist.reduce`` to its owner.

Groups launch strictly in plan order, each when all its buckets are full, so every rank
issues the same collectives in the same order. At launch the buffer is scaled by
``1 / world_size`` (DDP's ``mul_out``; compressed: divided in the wire dtype, as DDP's
compress hooks). On gloo a wait is bounded by the arrival timeout (a rank out of step:
:mod:`oss_plus.runtime.positions`) and returns once gloo's worker released the tensors
(:func:`oss_plus.runtime.dist.await_release`, docs/reliability.md).

Hybrid sharding (``replicate``: the ranks owning the same buckets in the other shard
groups): the scale is ``1 / (world_size x replicas)``; when a group's collective completed
(polled, no host read), the owner all-reduces its bucket (flags included) across the replicas
and takes the results when that completed. Groups complete in launch order, so every replica
issues the same all-reduces in the same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.data_parallel.compress import buffer_dtype
from oss_plus.data_parallel.plan import ReducePlan, launch_groups
from oss_plus.runtime import dist as _dist
from oss_plus.runtime import positions
from oss_plus.runtime.arrival import arrival_timeout
from oss_plus.runtime.trace import label

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
        flags: every bucket carries its members' "had a gradient" flags after its
            gradients (see "Used flags" in the module doc).
        replicate: hybrid sharding: the ranks owning the same buckets in the other shard
            groups (None: no replicas).

    .. warning:: Collective: every rank of ``group`` must fill the same buckets.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        plan: ReducePlan,
        group: Any,
        wire: torch.dtype | None,
        collective: str,
        flags: bool = False,
        replicate: Any = None,
    ) -> None:
        self.plan, self.group, self.replicate = plan, group, replicate
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._gloo = _dist.releases_late(group)  # gloo: the waits are bounded (looked up once)
        replicas = 1 if replicate is None else dist.get_world_size(replicate)
        self._divisor = self.world_size * replicas  # every rank's share of the average
        buckets = plan.buckets
        self.members = [[params[i] for i in b.members] for b in buckets]
        self.owned = [b.owner == self.rank for b in buckets]
        self.flat = [b.base >= 0 for b in buckets]
        self._gapped = [b.base >= 0 and sum(e - s for s, e in b.spans) < b.numel for b in buckets]
        self._dst = [_dist.global_rank(group, b.owner) for b in buckets]
        self._dtype = [buffer_dtype(m[0].dtype, wire) for m in self.members]
        self._compressed = [d != m[0].dtype for d, m in zip(self._dtype, self.members)]
        self._scatter = collective == "reduce_scatter"
        keys = [(d, m[0].device) for d, m in zip(self._dtype, self.members)]
        self.groups = launch_groups(plan, self._scatter, keys)
        self._group_of = [0] * len(buckets)
        for g, launch in enumerate(self.groups):
            for b in launch.buckets:
                self._group_of[b] = g
        #: Per bucket: the flags after its gradients (0: none), and what travels in all.
        self.tails = [len(b.members) if flags else 0 for b in buckets]
        self._sizes = [b.numel + t for b, t in zip(buckets, self.tails)]
        self._segments = [max(self._sizes[b] for b in g.buckets) for g in self.groups]
        self._templates = {b: self._flat_templates(b) for b in range(len(buckets)) if self.flat[b]}
        #: Persistent buckets: the flat buffer and the views that are their params' grads.
        self.flats: list[torch.Tensor | None] = [None] * len(buckets)
        self.views: list[list[torch.Tensor] | None] = [None] * len(buckets)
        #: Owned flat-key buckets: views of the owner's range buffer, shaped like the members
        #: (a piece 1-D), where the sums land (compressed: copied there at completion).
        self.receive: list[list[torch.Tensor] | None] = [None] * len(buckets)
        self._allocate_persistent()
        self.reset()

    @torch.no_grad()
    def _allocate_persistent(self) -> None:
        starts, ends = self._range_starts()
        ranges: dict[Any, torch.Tensor] = {}
        for b in range(len(self.plan.buckets)):
            members = self.members[b]
            if not self.owned[b]:
                continue
            if self.flat[b]:
                key = (members[0].dtype, members[0].device)
                if key not in ranges:
                    ranges[key] = torch.zeros(ends[key], dtype=key[0], device=key[1])
                flat = ranges[key][starts[b] : starts[b] + self._sizes[b]]
                self.receive[b] = self.member_views(b, flat)
                if not self._compressed[b]:
                    self.flats[b], self.views[b] = flat, self.receive[b]
                continue
            if self._compressed[b] or not all(p.is_contiguous() for p in members):
                continue  # a view could not honour the param's strides: copy instead
            size = self._segments[self._group_of[b]] if self._scatter else self._sizes[b]
            flat = torch.zeros(size, dtype=self._dtype[b], device=members[0].device)
            self.flats[b] = flat
            self.views[b] = self.member_views(b, flat)

    def _range_starts(self) -> tuple[dict[int, int], dict[Any, int]]:
        """Where each owned flat-key bucket starts in its key's range buffer (its offset in
        the range, moved up by the flags of the buckets before it), and each buffer's size."""
        starts: dict[int, int] = {}
        ends: dict[Any, int] = {}
        shift: dict[Any, int] = {}
        owned = [b for b in range(len(self.plan.buckets)) if self.owned[b] and self.flat[b]]
        for b in sorted(owned, key=lambda b: self.plan.buckets[b].base):
            key = (self.members[b][0].dtype, self.members[b][0].device)
            starts[b] = self.plan.buckets[b].base + shift.get(key, 0)
            shift[key] = shift.get(key, 0) + self.tails[b]
            ends[key] = max(ends.get(key, 0), starts[b] + self._sizes[b])
        return starts, ends

    def member_views(self, b: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (bucket ``b``'s storage) shaped like its members; a member that
        holds only a piece of its param (a flat key's) gets a 1-D view."""
        bucket = self.plan.buckets[b]
        if not self.flat[b]:
            return list(_unflatten(flat[: bucket.numel], self.members[b]))
        templates, picks = self._templates[b]
        views = _unflatten(flat[: bucket.numel], templates)  # one op for the bucket
        return [views[k] for k in picks]

    def _flat_templates(self, b: int) -> tuple[list[torch.Tensor], list[int]]:
        """Meta tensors shaped like bucket ``b``'s members (a piece 1-D) and the padding
        between them, in buffer order; and the positions of the members among them."""
        bucket, templates, picks, at = self.plan.buckets[b], [], [], 0
        for param, offset, (start, end) in zip(self.members[b], bucket.offsets, bucket.spans):
            if offset > at:
                templates.append(torch.empty(offset - at, device="meta"))
            picks.append(len(templates))
            whole = end - start == param.numel()
            templates.append(torch.empty(param.shape if whole else (end - start,), device="meta"))
            at = offset + end - start
        return templates, picks

    def reset(self) -> None:
        """Forget the transient buffers and the launch state (a new reduction starts)."""
        #: Transient buckets open now: views shaped like their members (None: not open).
        self.open: list[list[torch.Tensor] | None] = [None] * len(self.plan.buckets)
        self._buffers: list[torch.Tensor | None] = [None] * len(self.plan.buckets)
        self._inputs: list[torch.Tensor | None] = [None] * len(self.groups)
        self._left = [len(g.buckets) for g in self.groups]
        self.next = 0  # the next group to launch
        self._preset = [False] * len(self.plan.buckets)  # flags written by set_flags
        #: Owned buckets with a member this rank had no gradient for: the summed flags.
        self.flag_sums: dict[int, torch.Tensor] = {}
        self._needed: set[int] = set()
        self._works: deque[tuple[int, Any, torch.Tensor | None, list[Any]]] = deque()
        #: Hybrid: the all-reduces across the replicas in flight, in launch order.
        self._replicas: deque[tuple[int, Any, torch.Tensor | None, list[Any]]] = deque()
        #: Owned transient buckets whose sums arrived: (bucket, views shaped like members).
        self.results: list[tuple[int, list[torch.Tensor]]] = []

    # ----------------------------------------------------------------- filling
    def staged(self, b: int) -> list[torch.Tensor]:
        """Views (shaped like the members) of transient bucket ``b``, allocated on demand."""
        staged = self.open[b]
        if staged is None:
            flat = self._buffers[b] = self._segment(b)
            staged = self.open[b] = self.member_views(b, flat)
        return staged

    def _segment(self, b: int) -> torch.Tensor:
        """The flat storage of bucket ``b``: its own buffer, or its segment of the input."""
        size, device = self._sizes[b], self.members[b][0].device
        if self._gapped[b]:  # the padding between params travels too: zeros, not garbage
            return torch.zeros(size, dtype=self._dtype[b], device=device)
        if not self._scatter or self.flat[b]:
            return torch.empty(size, dtype=self._dtype[b], device=device)
        start = self.plan.buckets[b].owner * self._segments[self._group_of[b]]
        return self._input(self._group_of[b])[start : start + size]

    def _storage(self, b: int) -> torch.Tensor:
        """What bucket ``b`` sends from: its persistent buffer, or its transient one."""
        flat = self.flats[b]
        if flat is None:
            self.staged(b)
            flat = self._buffers[b]
        assert flat is not None
        return flat

    def set_flags(self, b: int, flags: Sequence[int]) -> None:
        """Write bucket ``b``'s flags (1: this rank had a gradient for the member); a bucket
        launched without them sends all ones."""
        numel = self.plan.buckets[b].numel
        tail = self._storage(b)[numel : numel + self.tails[b]]
        tail.fill_(1)  # then one op per run of zeros: no host-to-device copy, no sync
        start = None
        for slot, flag in enumerate([*flags, 1]):
            if not flag and start is None:
                start = slot
            elif flag and start is not None:
                tail[start:slot].zero_()
                start = None
        self._preset[b] = True
        if self.owned[b] and not all(flags):
            self._needed.add(b)

    def _input(self, g: int) -> torch.Tensor:
        flat = self._inputs[g]
        if flat is None:
            b = self.groups[g].buckets[0]
            size = self.world_size * self._segments[g]
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
        for b in self.groups[g].buckets:
            if self.tails[b] and not self._preset[b]:
                numel = self.plan.buckets[b].numel
                self._storage(b)[numel : numel + self.tails[b]].fill_(1)
        if self._scatter and not self.flat[first]:
            flat, target, out = self._scatter_buffers(g)
        else:
            if self.flats[first] is None:
                self.staged(first)
            buffer = self.flats[first] if self.flats[first] is not None else self._buffers[first]
            assert buffer is not None
            flat = target = buffer
            out = None
        if self._compressed[first]:
            flat.div_(self._divisor)
        else:
            flat.mul_(1.0 / self._divisor)
        given = [flat] if target is flat else [flat, target]
        counts = _dist.use_counts(given)
        with label("oss_plus::sdp::reduce_bucket"):
            if self._scatter and not self.flat[first]:
                work = dist.reduce_scatter_tensor(target, flat, group=self.group, async_op=True)
            else:
                work = dist.reduce(flat, dst=self._dst[first], group=self.group, async_op=True)
        self._works.append((g, work, out, [given, counts]))
        del work  # held by the queue only: its completion waits for the release
        while self._works and self._works[0][1].is_completed():
            self.complete_oldest()  # release finished transient buffers early
        while self._replicas and self._replicas[0][1].is_completed():
            self._complete_replica()

    def _mine(self, g: int) -> int | None:
        for b in self.groups[g].buckets:
            if self.owned[b]:
                return b
        return None

    def _scatter_buffers(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The group's input (this rank's persistent bucket copied in), the output, and the
        output again when it is transient (None when it is the persistent bucket)."""
        flat, segment = self._input(g), self._segments[g]
        mine = self._mine(g)
        own = self.flats[mine] if mine is not None else None
        if own is not None:
            size = self._sizes[mine]  # type: ignore[index]
            flat[self.rank * segment : self.rank * segment + size].copy_(own[:size])
            return flat, own, None
        out = torch.empty(segment, dtype=flat.dtype, device=flat.device)
        return flat, out, out

    # ----------------------------------------------------------------- completion
    def complete_oldest(self) -> None:
        """Wait for the oldest collective and gloo's release of its tensors; release its
        transient buffers; queue owned transient results (hybrid: all-reduce them first)."""
        g, work, out, (given, counts) = self._works.popleft()
        bound = arrival_timeout() if self._gloo else None  # NCCL: its watchdog's timeout
        positions.wait(work, self.group, bound, "backward()", "in ShardedDataParallel's backward()")
        del work  # the work object holds the tensors too
        if self._gloo:
            _dist.await_counts(given, counts)
        mine = self._mine(g) if self.replicate is not None else None
        if mine is None:
            self._complete_group(g, out)
            return
        # the sum (flags too): a transient reduce_scatter output, else the bucket's storage
        sums = (out if out is not None else self._storage(mine))[: self._sizes[mine]]
        uses = _dist.use_counts([sums])
        with label("oss_plus::sdp::replicate_bucket"):
            work = dist.all_reduce(sums, group=self.replicate, async_op=True)
        self._replicas.append((g, work, out, [[sums], uses]))
        del work

    def _complete_replica(self) -> None:
        """Wait for the oldest all-reduce across the replicas; complete its group."""
        g, work, out, (given, counts) = self._replicas.popleft()
        work.wait()
        del work
        _dist.await_release(given, counts, self.replicate)
        self._complete_group(g, out)

    def _complete_group(self, g: int, out: torch.Tensor | None) -> None:
        for b in self.groups[g].buckets:
            staged, numel = self.open[b], self.plan.buckets[b].numel
            if b in self._needed:  # the summed flags, where the sum landed
                sums = out if out is not None else self.flats[b]
                sums = sums if sums is not None else self._buffers[b]
                self.flag_sums[b] = sums[numel : numel + self.tails[b]]  # type: ignore[index]
            self.open[b] = self._buffers[b] = None
            if not self.owned[b] or self.flats[b] is not None:
                continue  # not ours, or persistent: the grads (views) hold the sums already
            if out is not None:  # reduce_scatter: the sum is in the output, not the input
                staged = list(_unflatten(out[:numel], self.members[b]))
            assert staged is not None
            receive = self.receive[b]
            if receive is not None:  # a compressed flat bucket: widen into the range
                torch._foreach_copy_(receive, staged)
                staged = receive
            self.results.append((b, staged))
        self._inputs[g] = None

    def complete_all(self) -> None:
        """Wait for every collective in flight."""
        while self._works:
            self.complete_oldest()
        while self._replicas:
            self._complete_replica()
