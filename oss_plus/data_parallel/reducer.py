"""Runs a :class:`~oss_plus.data_parallel.plan.ReducePlan` during backward.

One :class:`GradReducer` per plan; its cost per iteration is one post-accumulate-grad hook
call per param plus a few tensor ops per *bucket*, and it reads no tensor value on the host
unless a rank owns a param that got no gradient on it (see "Unused params" below).

Buckets (:mod:`~oss_plus.data_parallel.buckets`): the params a rank owns have their
``.grad`` as views of persistent flat buckets (nothing is copied when a gradient accumulates
into them); other gradients are copied into transient buckets as they arrive and, on a rank
that does not own them, dropped at once (ZeRO-2). Buckets are sent in plan order, each as
soon as it and every bucket before it are full, so every rank issues the same collectives.

Unused params. At the end of backward (an autograd engine callback) a member whose hook
did not fire counts as its ``.grad`` accumulated earlier, or as zeros. Then (unless
``find_unused_parameters=False``) one small ``all_reduce`` (MAX) of per-param "had a
gradient" bytes is launched, built from host-side
bookkeeping (no device read). The owner reads its result on the host only for params it had
no gradient for itself (a param it used is used somewhere): a param with no gradient on any
rank keeps ``.grad = None`` on its owner, as DDP leaves globally unused params untouched.
Every work handle is waited for before the callback returns; nothing outlives the iteration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from oss_plus import _dist
from oss_plus.data_parallel.buckets import Buckets
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
        collective: ``"reduce"`` or ``"reduce_scatter"``.
        record: record the order the first backward produces the gradients in.
        find_unused: all-reduce the used flags, so a param without a gradient on every rank
            keeps ``grad=None`` (else it gets the zero sum).
        give_piece: receives ``(param index, gradient of this rank's piece or None)`` for a
            param of a split bucket this rank holds a piece of (its ``.grad`` is dropped on
            every rank: a holder keeps only its range).

    .. warning:: Collective: every rank of ``group`` must run the same backward passes.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        plan: ReducePlan,
        group: Any,
        wire: torch.dtype | None,
        collective: str = "reduce",
        record: bool = False,
        find_unused: bool = True,
        give_piece: Callable[[int, torch.Tensor | None], None] | None = None,
    ) -> None:
        self.params = list(params)
        self.plan = plan
        self.group = group
        self.collective = collective
        self.find_unused = find_unused
        self._give_piece = give_piece
        self._buckets = Buckets(self.params, plan, group, wire, collective)
        self._bucket_of = [0] * len(self.params)
        self._slot_of = [0] * len(self.params)
        for b, bucket in enumerate(plan.buckets):
            for slot, index in enumerate(bucket.members):
                self._bucket_of[index], self._slot_of[index] = b, slot
        self._counts = [len(b.members) for b in plan.buckets]
        self._persistent = [b for b, v in enumerate(self._buckets.views) if v is not None]
        self._zeroed = bytearray(len(self.params))  # grads set by _preset, until reduced
        self._state = _State.IDLE
        self._pending = False
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, p in enumerate(self.params)
        ]
        #: With ``record``: the order the first reducing backward produced the gradients in.
        self.observed: list[int] | None = None
        self._seen: list[int] = []
        self._recorders = [
            p.register_post_accumulate_grad_hook(self._recorder_for(i))
            for i, p in enumerate(self.params)
            if record
        ]

    def _recorder_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def record(_: torch.Tensor) -> None:
            if self._state is _RUNNING:
                self._seen.append(index)

        return record

    def _reset(self) -> None:
        self._buckets.reset()
        self._left = list(self._counts)
        self._fired = bytearray(len(self.params))  # 1: has a gradient in this reduction
        self._unused: dict[int, list[int]] = {}  # bucket -> slots with no local gradient
        self._deferred: list[tuple[int, torch.Tensor]] = []  # owned, unused: (index, sum)
        self._deferred_pieces: list[tuple[int, torch.Tensor]] = []  # (index, piece's sum)

    def remove(self) -> None:
        """Detach the hooks (the reducer is being replaced)."""
        for handle in self._handles + self._recorders:
            handle.remove()
        self._handles, self._recorders = [], []

    # ----------------------------------------------------------------- pass control
    def start_pass(self, reduce: bool) -> None:
        """Called at every forward: the next backward reduces iff ``reduce``."""
        self._reset()
        self._state = _State.ARMED if reduce else _State.IDLE
        self._pending = True
        if reduce:
            self._preset()
        else:  # accumulating (no_sync): a zeroed view now gathers real gradients
            self._zeroed = bytearray(len(self.params))

    @torch.no_grad()
    def _preset(self) -> None:
        """Owned grads that are None become zeroed views of their bucket, so backward
        accumulates into the bucket (in C++) and the hook copies nothing. Remembered in
        ``_zeroed``: such a param that gets no gradient still counts as having none."""
        buckets = self._buckets
        for b in self._persistent:
            members, views = buckets.members[b], buckets.views[b]
            assert views is not None
            empty = [slot for slot, p in enumerate(members) if p.grad is None]
            if not empty:
                continue
            if len(empty) == len(members):
                flat = buckets.flats[b]
                assert flat is not None
                flat.zero_()
            for slot in empty:
                if len(empty) < len(members):
                    views[slot].zero_()
                members[slot].grad = views[slot]
                self._zeroed[self.plan.buckets[b].members[slot]] = 1

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
        reducer, buckets = self, self._buckets
        b, slot = self._bucket_of[index], self._slot_of[index]
        views = buckets.views[b]
        view = None if views is None else views[slot]
        owned = buckets.owned[b] and not self.plan.buckets[b].pieces  # keeps the whole grad

        def staging_hook(param: torch.Tensor) -> None:  # copied into a transient bucket
            if reducer._state is not _RUNNING and not reducer._begin():
                return
            fired = reducer._fired
            if fired[index]:
                return
            fired[index] = 1
            grad: torch.Tensor = param.grad  # type: ignore[assignment]
            (buckets.open[b] or buckets.staged(b))[slot].copy_(
                grad.detach() if grad.requires_grad else grad
            )
            if not owned:
                param.grad = None  # copied: free it now (ZeRO-2)
            left = reducer._left
            left[b] -= 1
            if left[b] == 0:
                buckets.bucket_full(b)

        if view is None:
            return staging_hook
        bucket_view: torch.Tensor = view

        def hook(param: torch.Tensor) -> None:  # an owned param: .grad is a bucket view
            if reducer._state is not _RUNNING and not reducer._begin():
                return
            fired = reducer._fired
            if fired[index]:
                return  # a second gradient in the same backward (reentrant): already in
            fired[index] = 1
            grad: torch.Tensor = param.grad  # type: ignore[assignment]  # set: it fired
            if grad is not bucket_view:
                bucket_view.copy_(grad.detach() if grad.requires_grad else grad)  # create_graph
                param.grad = bucket_view
            left = reducer._left
            left[b] -= 1
            if left[b] == 0:
                buckets.bucket_full(b)

        return hook

    def _take_results(self) -> None:
        """Owner of transient buckets: widen the sums into its grads (unused: deferred)."""
        for b, sums in self._buckets.results:
            pieces = self.plan.buckets[b].pieces
            if pieces:  # a split param: hand the sum of this rank's piece over
                index = self.plan.buckets[b].members[0]
                mine = self._own_piece(index, sums[0], pieces)
                if 0 in self._unused.get(b, ()):
                    self._deferred_pieces.append((index, mine))
                else:
                    self._hand_over(index, mine)
                continue
            unused = self._unused.get(b, ())
            grads, values = [], []
            for slot, (param, value) in enumerate(zip(self._buckets.members[b], sums)):
                if slot in unused:
                    self._deferred.append((self.plan.buckets[b].members[slot], value))
                elif param.grad is not None:
                    grads.append(param.grad)
                    values.append(value)
            if grads:
                torch._foreach_copy_(grads, values)
        self._buckets.results = []

    @torch.no_grad()
    def _fill_missing(self) -> None:
        """End of backward: complete the buckets whose hooks did not all fire."""
        for b, left in enumerate(self._left):
            if left == 0:
                continue
            views = self._buckets.views[b]
            for slot, index in enumerate(self.plan.buckets[b].members):
                if self._fired[index]:
                    continue
                param = self.params[index]
                preset = self._zeroed[index] and views is not None and param.grad is views[slot]
                if param.grad is None or preset:
                    self._unused.setdefault(b, []).append(slot)
                    (views or self._buckets.staged(b))[slot].zero_()
                    continue
                self._fired[index] = 1  # accumulated earlier (no_sync): counts as used
                if views is None:
                    keep = self._buckets.owned[b] and not self.plan.buckets[b].pieces
                    _stage(self._buckets.staged(b)[slot], param, keep)
                elif param.grad is not views[slot]:
                    views[slot].copy_(param.grad)
                    param.grad = views[slot]
            self._left[b] = 0
        self._buckets.mark_all_full()

    def _launch_flags(self) -> tuple[torch.Tensor, Any] | None:
        """All-reduce (MAX) the per-param "had a gradient" bytes; no device value is read."""
        if not self.params:
            return None
        used = torch.frombuffer(self._fired, dtype=torch.uint8)
        device = _dist.comm_device(self.group)
        used = used.clone() if device.type == "cpu" else used.to(device, non_blocking=True)
        work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return used, work

    def _settle_unused(self, anywhere: list[int] | None) -> None:
        """Owner, for params it had no gradient for: a gradient iff some rank had one (with
        ``anywhere`` None, unknown: the sum, zeros if no rank had one, as fairscale)."""
        for b, slots in self._unused.items():
            views = self._buckets.views[b]
            if views is None or not self._buckets.owned[b]:
                continue  # transient: in self._deferred
            for slot in slots:
                index = self.plan.buckets[b].members[slot]
                used = anywhere is None or anywhere[index]
                self.params[index].grad = views[slot] if used else None
        for index, reduced in self._deferred:
            param = self.params[index]
            used = anywhere is None or anywhere[index]
            param.grad = reduced.to(param.dtype, copy=True) if used else None
        for index, piece in self._deferred_pieces:
            self._hand_over(index, piece if anywhere is None or anywhere[index] else None)

    def _own_piece(
        self, index: int, value: torch.Tensor, pieces: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """This rank's range of a split param's reduced gradient, as a new tensor of the
        param's dtype (the bucket's buffer is released)."""
        rank = self._buckets.rank
        start, end = next((a, b) for a, b, owner in pieces if owner == rank)
        dtype = self.params[index].dtype
        return value.reshape(-1)[start:end].to(dtype, copy=True)

    def _hand_over(self, index: int, piece: torch.Tensor | None) -> None:
        assert self._give_piece is not None, "a split bucket needs give_piece"
        self._give_piece(index, piece)

    def _finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, settle unused."""
        with torch.profiler.record_function("oss_plus::sdp::flush"):
            buckets = self._buckets
            if buckets.next < len(buckets.groups):
                self._fill_missing()
                buckets.launch_ready()
            flags = self._launch_flags() if self.find_unused else None
            buckets.complete_all()
            self._take_results()
            if flags is not None:
                flags[1].wait()
                if any(buckets.owned[b] for b in self._unused):
                    self._settle_unused(flags[0].tolist())  # the one host read, only then
            elif any(buckets.owned[b] for b in self._unused):
                self._settle_unused(None)
            self._unused, self._deferred, self._deferred_pieces = {}, [], []
            self._zeroed = bytearray(len(self.params))
            if self._recorders and self._seen:  # the first reducing backward: keep its order
                self.observed = list(dict.fromkeys(self._seen))
                for handle in self._recorders:
                    handle.remove()
                self._recorders = []
            self._state = _State.DONE
            self._pending = False


def _stage(out: torch.Tensor, param: torch.Tensor, owned: bool) -> None:
    """Copy ``param``'s gradient into its slot ``out`` of a transient bucket; drop it unless
    this rank owns it (then it receives the sum later)."""
    grad = param.grad
    assert grad is not None
    out.copy_(grad.detach() if grad.requires_grad else grad)
    if not owned:
        param.grad = None  # copied: free it now
