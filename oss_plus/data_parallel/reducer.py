"""Runs a :class:`~oss_plus.data_parallel.plan.ReducePlan` during backward.

One :class:`GradReducer` per plan. Each trainable param gets a post-accumulate-grad hook;
when a param's gradient is ready it is divided by the world size into its bucket's flat
buffer (a bucket holding a single uncompressed param is reduced in place, in ``.grad``), and
on a rank that does not own it, ``.grad`` is dropped at once. Buckets are launched strictly
in plan order (a bucket waits for the ones before it), so every rank issues the same
collectives in the same order even when backward reaches params in a different order or
some params get no gradient. At the end of backward a callback launches what is left (a
missing gradient counts as zeros, or as the ``.grad`` accumulated earlier) plus one small
``all_reduce`` of per-param "had a gradient" flags, waits, and finishes every bucket: the
owner copies the average into ``.grad``; a param that had no gradient on any rank keeps
``.grad = None`` on its owner too (as DDP leaves globally unused params untouched).

Finished buckets are released as soon as their collective completes (checked at every
hook), so the transient memory is the buckets in flight, not the model.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from oss_plus import _dist
from oss_plus.data_parallel.compress import buffer_dtype, pack_, unpack_
from oss_plus.data_parallel.plan import Bucket, ReducePlan

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


class _State(Enum):
    IDLE = "idle"  # hooks do nothing (no forward yet, no_sync, eval or no_grad forward)
    ARMED = "armed"  # the next backward reduces
    RUNNING = "running"  # a backward is reducing
    DONE = "done"  # reduced; another backward before the next forward is an error


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
        self.wire = wire
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._dst = [_dist.global_rank(group, b.owner) for b in plan.buckets]
        self._in_place = [self._reduces_in_place(b) for b in plan.buckets]
        self._state = _State.IDLE
        self._pending = False
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, p in enumerate(self.params)
        ]

    def _reduces_in_place(self, bucket: Bucket) -> bool:
        param = self.params[bucket.members[0]]
        return len(bucket.members) == 1 and buffer_dtype(param.dtype, self.wire) == param.dtype

    def _reset(self) -> None:
        count = len(self.plan.buckets)
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._ready = [0] * count
        self._filled = [[False] * len(b.members) for b in self.plan.buckets]
        self._used = torch.zeros(len(self.params), dtype=torch.int32)
        self._next = 0
        self._works: deque[tuple[int, Any]] = deque()
        self._deferred: list[tuple[int, torch.Tensor]] = []

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
        if not self._pending or self._state is _State.RUNNING:
            raise RuntimeError(NOTHING_TO_REDUCE)
        self._reset()
        self._finish()

    # ----------------------------------------------------------------- backward hooks
    def _hook_for(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return hook

    @torch.no_grad()
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if self._state is _State.IDLE:
            return
        if self._state is _State.DONE:
            raise RuntimeError(SECOND_BACKWARD)
        if self._state is _State.ARMED:
            self._state = _State.RUNNING
            Variable._execution_engine.queue_callback(self._finish)
        b, slot = self.plan.position[index]
        if self._filled[b][slot]:
            return
        self._fill(b, slot, param)
        self._ready[b] += 1
        self._launch_ready()
        self._complete(block=False)

    def _fill(self, b: int, slot: int, param: torch.Tensor) -> None:
        """Put ``param``'s gradient (zeros if it has none) into bucket ``b``; mark it used."""
        bucket = self.plan.buckets[b]
        grad = param.grad
        index = bucket.members[slot]
        self._used[index] = int(grad is not None)
        self._filled[b][slot] = True
        if self._in_place[b]:
            if grad is None:
                buffer = torch.zeros_like(param, memory_format=torch.contiguous_format)
            else:
                buffer = grad if grad.is_contiguous() else grad.contiguous()
            buffer.mul_(1.0 / self.world_size)
            self._buffers[b] = buffer
            return
        flat = self._buffers[b]
        if flat is None:
            dtype = buffer_dtype(param.dtype, self.wire)
            flat = torch.empty(bucket.numel, dtype=dtype, device=param.device)
            self._buffers[b] = flat
        out = flat[bucket.offsets[slot] : bucket.offsets[slot] + param.numel()]
        if grad is None:
            out.zero_()
            return
        pack_(out, grad, self.world_size)
        if bucket.owner != self.rank:
            param.grad = None  # copied: free it now

    def _launch_ready(self) -> None:
        buckets = self.plan.buckets
        while self._next < len(buckets) and self._ready[self._next] == len(
            buckets[self._next].members
        ):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        buffer = self._buffers[b]
        assert buffer is not None
        with torch.profiler.record_function("oss_plus::sdp::reduce_bucket"):
            work = dist.reduce(buffer, dst=self._dst[b], group=self.group, async_op=True)
        self._works.append((b, work))

    # ----------------------------------------------------------------- completion
    def _complete(self, block: bool) -> None:
        """Finish the oldest launched buckets (all of them with ``block``)."""
        while self._works and (block or self._works[0][1].is_completed()):
            b, work = self._works.popleft()
            work.wait()
            self._finish_bucket(b)

    def _finish_bucket(self, b: int) -> None:
        bucket = self.plan.buckets[b]
        buffer = self._buffers[b]
        self._buffers[b] = None
        assert buffer is not None
        mine = bucket.owner == self.rank
        for slot, index in enumerate(bucket.members):
            param = self.params[index]
            if not mine:
                param.grad = None
                continue
            reduced = buffer.view(-1)[bucket.offsets[slot] : bucket.offsets[slot] + param.numel()]
            if not self._used[index]:
                self._deferred.append((index, reduced))  # None or zeros: decided by the flags
            elif param.grad is not buffer:
                assert param.grad is not None
                unpack_(param.grad, reduced)

    def _finish(self) -> None:
        """End of backward: launch what is left, agree on used flags, finish every bucket."""
        with torch.profiler.record_function("oss_plus::sdp::flush"):
            for b, bucket in enumerate(self.plan.buckets):
                for slot, index in enumerate(bucket.members):
                    if not self._filled[b][slot]:
                        self._fill(b, slot, self.params[index])
                self._ready[b] = len(bucket.members)
            self._launch_ready()
            used = self._used.to(_dist.comm_device(self.group), copy=True)  # reduced async
            flags = dist.all_reduce(used, group=self.group, async_op=True)
            self._complete(block=True)
            assert flags is not None
            flags.wait()
            anywhere = used.cpu().tolist()
            for index, reduced in self._deferred:
                param = self.params[index]
                param.grad = (
                    reduced.to(param.dtype, copy=True).view_as(param) if anywhere[index] else None
                )
            self._deferred = []
            self._state = _State.DONE
            self._pending = False
