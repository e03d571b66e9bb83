"""Runs a :class:`~oss_plus.data_parallel.plan.ReducePlan` during backward.

One :class:`GradReducer` per plan; its cost per iteration is one post-accumulate-grad hook
call per param plus a few tensor ops per *bucket*, and it reads no tensor value on the host
unless a rank owns a param that got no gradient on it (see "Unused params" below).

Buffers. A bucket this rank owns (uncompressed, contiguous members) has a *persistent* flat
buffer, allocated once, and its params' ``.grad`` are views of it, like DDP's
``gradient_as_bucket_view``: a gradient accumulated into ``.grad`` lands in the bucket and
nothing is copied. Other buckets are *transient*: allocated when their first gradient
arrives, released when their collective completes; on a rank that does not own them each
gradient is copied in and ``.grad`` is dropped at once (ZeRO-2). So the memory is 1/N of
the gradients plus the buckets in flight.

Order. A bucket is launched when all its members are in and every bucket before it in the
plan is launched, so every rank issues the same collectives in the same order. At launch
the bucket is scaled by ``1 / world_size`` (DDP's ``mul_out``; compressed: cast, then
divided in the wire dtype, as DDP's compress hooks).

Unused params. At the end of backward (an autograd engine callback) a member whose hook
did not fire counts as its ``.grad`` accumulated earlier, or as zeros. Then one small
``all_reduce`` (MAX) of per-param "had a gradient" bytes is launched, built from host-side
bookkeeping (no device read). The owner reads its result on the host only for params it had
no gradient for itself (a param it used is used somewhere): a param with no gradient on any
rank keeps ``.grad = None`` on its owner, as DDP leaves globally unused params untouched.
Every work handle is waited for before the callback returns; nothing outlives the iteration.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from oss_plus import _dist
from oss_plus.data_parallel.compress import buffer_dtype
from oss_plus.data_parallel.plan import ReducePlan

__all__ = ["GradReducer", "NOTHING_TO_REDUCE", "SECOND_BACKWARD"]

logger = logging.getLogger(__name__)

#: Raised when a backward reaches the params again after their gradients were reduced.
SECOND_BACKWARD = (
    "ShardedDataParallel: a second backward pass after one forward: the gradients of the "
    "first were already reduced to their owners (other ranks dropped theirs). Run the "
    "forward again before each backward, or accumulate under no_sync()"
)
#: Raised by a manual reduce() with nothing pending.
NOTHING_TO_REDUCE = (
    "ShardedDataParallel.reduce(): no gradients are waiting to be reduced (no forward in "
    "training mode since the last reduction). Call it after a backward run inside no_sync()"
)

_unflatten = torch._C._nn.unflatten_dense_tensors


class _State(Enum):
    IDLE = "idle"  # hooks do nothing (no forward yet, no_sync, eval or no_grad forward)
    ARMED = "armed"  # the next backward reduces
    RUNNING = "running"  # a backward is reducing
    DONE = "done"  # reduced; another backward before the next forward is an error


_RUNNING = _State.RUNNING


class GradReducer:
    """Reduces each trainable param's gradient to its owner during backward (see module doc).

    Args:
        params: the trainable params, indexed like the plan's specs.
        plan: the buckets.
        group: the process group (every rank holds the same plan).
        wire: compress floating gradients to this dtype on the wire (None: no compression).

    .. warning:: Collective: every rank of ``group`` must run the same backward passes.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        plan: ReducePlan,
        group: Any,
        wire: torch.dtype | None,
    ) -> None:
        self.params = list(params)
        self.plan = plan
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        buckets = plan.buckets
        self._dst = [_dist.global_rank(group, b.owner) for b in buckets]
        self._members = [[self.params[i] for i in b.members] for b in buckets]
        self._counts = [len(b.members) for b in buckets]
        self._owned = [b.owner == self.rank for b in buckets]
        self._dtype = [buffer_dtype(m[0].dtype, wire) for m in self._members]
        self._compressed = [d != m[0].dtype for d, m in zip(self._dtype, self._members)]
        self._bucket_of = [0] * len(self.params)
        self._slot_of = [0] * len(self.params)
        for b, bucket in enumerate(buckets):
            for slot, index in enumerate(bucket.members):
                self._bucket_of[index], self._slot_of[index] = b, slot
        self._flats: list[torch.Tensor | None] = [None] * len(buckets)
        self._views: list[list[torch.Tensor] | None] = [None] * len(buckets)
        self._allocate_persistent()
        self._state = _State.IDLE
        self._pending = False
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, p in enumerate(self.params)
        ]

    @torch.no_grad()
    def _allocate_persistent(self) -> None:
        """One flat buffer per owned, uncompressed bucket; its params' grads are views of it."""
        for b, bucket in enumerate(self.plan.buckets):
            members = self._members[b]
            if not self._owned[b] or self._compressed[b]:
                continue
            if not all(p.is_contiguous() for p in members):
                continue  # a view could not honour the param's strides: copy instead
            flat = torch.zeros(bucket.numel, dtype=self._dtype[b], device=members[0].device)
            self._flats[b] = flat
            self._views[b] = list(_unflatten(flat, members))

    def _reset(self) -> None:
        count = len(self.plan.buckets)
        self._left = list(self._counts)
        self._fired = bytearray(len(self.params))  # 1: has a gradient in this reduction
        self._staged: list[list[torch.Tensor] | None] = [None] * count
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._unused: dict[int, list[int]] = {}  # bucket -> slots with no local gradient
        self._deferred: list[tuple[int, torch.Tensor]] = []  # owned, unused: (index, sum)
        self._next = 0
        self._works: deque[tuple[int, Any]] = deque()

    def remove(self) -> None:
        """Detach the hooks (the reducer is being replaced)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ----------------------------------------------------------------- pass control
    def start_pass(self, reduce: bool) -> None:
        """Called at every forward: the next backward reduces iff ``reduce``."""
        self._reset()
        self._state = _State.ARMED if reduce else _State.IDLE
        self._pending = True

    def quiet(self) -> None:
        """Called at a forward that must not reduce (eval mode, no_grad): a backward through
        it leaves gradients local. A training forward still waiting for its backward stays
        armed."""
        if self._state is _State.DONE:
            self._state = _State.IDLE

    @property
    def pending(self) -> bool:
        """True between a forward in training mode and the reduction of its gradients."""
        return self._pending

    def reduce_now(self) -> None:
        """Reduce the current ``.grad`` of every param (manual ``reduce()``).

        Raises:
            RuntimeError: nothing is pending (see :data:`NOTHING_TO_REDUCE`).

        .. warning:: Collective: call on every rank of ``group``.
        """
        if not self._pending or self._state is _RUNNING:
            raise RuntimeError(NOTHING_TO_REDUCE)
        self._reset()
        self._finish()

    # ----------------------------------------------------------------- backward hooks
    def _begin(self) -> bool:
        """First hook of a backward: start reducing if armed. Returns whether to reduce."""
        if self._state is _State.IDLE:
            return False
        if self._state is _State.DONE:
            raise RuntimeError(SECOND_BACKWARD)
        self._state = _RUNNING
        Variable._execution_engine.queue_callback(self._finish)
        return True

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        """The hook of param ``index``: the only per-param Python work of an iteration."""
        reducer, b = self, self._bucket_of[index]
        views = self._views[b]
        view = None if views is None else views[self._slot_of[index]]

        def hook(param: torch.Tensor) -> None:
            if reducer._state is not _RUNNING and not reducer._begin():
                return
            fired = reducer._fired
            if fired[index]:
                return  # a second gradient in the same backward (reentrant): already in
            fired[index] = 1
            if view is None:
                reducer._stage(b, index, param)
            else:
                grad: torch.Tensor = param.grad  # type: ignore[assignment]  # set: it fired
                if grad is not view:
                    if grad.requires_grad:  # create_graph=True: keep the bucket out of it
                        grad = grad.detach()
                    view.copy_(grad)
                    param.grad = view
            left = reducer._left
            left[b] -= 1
            if left[b] == 0 and b == reducer._next:
                reducer._launch_ready()

        return hook

    def _stage(self, b: int, index: int, param: torch.Tensor) -> None:
        """Copy ``param``'s gradient into transient bucket ``b``; drop it if not owned."""
        staged = self._staged[b]
        if staged is None:
            staged = self._open(b)
        grad = param.grad
        assert grad is not None
        staged[self._slot_of[index]].copy_(grad.detach() if grad.requires_grad else grad)
        if not self._owned[b]:
            param.grad = None  # copied: free it now

    def _open(self, b: int) -> list[torch.Tensor]:
        """Allocate transient bucket ``b``; return views of it shaped like its members."""
        members = self._members[b]
        flat = torch.empty(
            self.plan.buckets[b].numel, dtype=self._dtype[b], device=members[0].device
        )
        self._buffers[b] = flat
        staged = self._staged[b] = list(_unflatten(flat, members))
        return staged

    # ----------------------------------------------------------------- launching
    def _launch_ready(self) -> None:
        left, count = self._left, len(self._left)
        while self._next < count and left[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        flat = self._flats[b]
        if flat is None:
            if self._staged[b] is None:
                self._open(b)
            flat = self._buffers[b]
            assert flat is not None
        if self._compressed[b]:
            flat.div_(self.world_size)
        else:
            flat.mul_(1.0 / self.world_size)
        with torch.profiler.record_function("oss_plus::sdp::reduce_bucket"):
            work = dist.reduce(flat, dst=self._dst[b], group=self.group, async_op=True)
        self._works.append((b, work))
        while self._works and self._works[0][1].is_completed():
            self._complete_oldest()  # release finished transient buffers early

    # ----------------------------------------------------------------- completion
    def _complete_oldest(self) -> None:
        b, work = self._works.popleft()
        work.wait()
        if self._flats[b] is not None:
            return  # persistent: the grads (views) hold the averages already
        staged, members = self._staged[b], self._members[b]
        self._staged[b] = self._buffers[b] = None  # released (the views below keep theirs)
        if not self._owned[b]:
            return
        assert staged is not None
        unused = self._unused.get(b, ())
        grads: list[torch.Tensor] = []
        sums: list[torch.Tensor] = []
        for slot, (param, view) in enumerate(zip(members, staged)):
            if slot in unused:
                self._deferred.append((self.plan.buckets[b].members[slot], view))
            elif param.grad is not None:
                grads.append(param.grad)
                sums.append(view)
        if grads:
            torch._foreach_copy_(grads, sums)  # widen into the owner's grads

    @torch.no_grad()
    def _fill_missing(self) -> None:
        """End of backward: complete the buckets whose hooks did not all fire."""
        for b in range(self._next, len(self._left)):
            if self._left[b] == 0:
                continue
            views = self._views[b]
            for slot, index in enumerate(self.plan.buckets[b].members):
                if self._fired[index]:
                    continue
                param = self.params[index]
                if param.grad is None:
                    self._unused.setdefault(b, []).append(slot)
                    target = views or self._staged[b] or self._open(b)
                    target[slot].zero_()
                    continue
                self._fired[index] = 1  # accumulated earlier (no_sync): counts as used
                if views is None:
                    self._stage(b, index, param)
                elif param.grad is not views[slot]:
                    views[slot].copy_(param.grad)
                    param.grad = views[slot]
            self._left[b] = 0

    def _launch_flags(self) -> tuple[torch.Tensor, Any] | None:
        """All-reduce (MAX) the per-param "had a gradient" bytes; no device value is read."""
        if not self.params:
            return None
        used = torch.frombuffer(self._fired, dtype=torch.uint8)
        device = _dist.comm_device(self.group)
        used = used.clone() if device.type == "cpu" else used.to(device, non_blocking=True)
        work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return used, work

    def _settle_unused(self, anywhere: list[int]) -> None:
        """Owner, for params it had no gradient for: a gradient iff some rank had one."""
        for b, slots in self._unused.items():
            views = self._views[b]
            if views is None:
                continue  # transient: in self._deferred
            for slot in slots:
                index = self.plan.buckets[b].members[slot]
                self.params[index].grad = views[slot] if anywhere[index] else None
        for index, reduced in self._deferred:
            param = self.params[index]
            param.grad = reduced.to(param.dtype, copy=True) if anywhere[index] else None

    def _finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, settle unused."""
        with torch.profiler.record_function("oss_plus::sdp::flush"):
            if self._next < len(self._left):
                self._fill_missing()
                self._launch_ready()
            flags = self._launch_flags()
            while self._works:
                self._complete_oldest()
            if flags is not None:
                flags[1].wait()
                owned_unused = any(self._owned[b] for b in self._unused)
                if owned_unused:  # the one host read, only when this rank lacks a gradient
                    self._settle_unused(flags[0].tolist())
            self._unused, self._deferred = {}, []
            self._state = _State.DONE
            self._pending = False
