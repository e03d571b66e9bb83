"""Runs a :class:`~oss_plus.data_parallel.plan.ReducePlan` during backward.

One :class:`GradReducer` per plan; its cost per iteration is one post-accumulate-grad hook
call per param (:mod:`~oss_plus.data_parallel.hooks`) plus a few tensor ops per *bucket*,
nothing per param at forward, and it reads no tensor value on the host unless a rank owns
a param that got no gradient on it (see "Unused params" below).

Buckets (:mod:`~oss_plus.data_parallel.buckets`): the params a rank owns have their
``.grad`` as views of persistent flat buckets (a gradient accumulated into them is not
copied); other gradients are copied into transient buckets as they arrive and, on a rank
that does not own them, dropped at once (ZeRO-2). Buckets are sent in plan order, each as
soon as it and every bucket before it are full, so every rank issues the same collectives.

Unused params. At the end of backward (an autograd engine callback) a member whose hook
did not fire counts as its ``.grad`` accumulated earlier, or as zeros. Unless
``find_unused_parameters=False``, every bucket carries one "had a gradient" flag per member
after its gradients, summed with them by the same collective (no collective of its own):
ones for a bucket whose hooks all fired, written from host-side bookkeeping for the
buckets completed at the end of backward (no device read). The owner reads the summed
flags on the host only for params it had no gradient for itself: a param with no gradient
on any rank keeps ``.grad = None`` on its owner, as DDP leaves globally unused params
untouched. Every work handle is waited for (and on gloo its release)
before the callback returns; nothing outlives the iteration.

Double backward. A gradient that requires grad (``backward(create_graph=True)``, or a
``.grad`` that requires grad) is refused as fairscale refuses it: the backward that saw it
raises :data:`GRAD_REQUIRES_GRAD` at its end, after every collective completed, on the
ranks that saw it (every rank, when every rank runs the same code), and so does the next
forward while such a gradient is still there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch
from torch.autograd import Variable

from oss_plus.data_parallel.buckets import Buckets
from oss_plus.data_parallel.hooks import copy_pieces, make_hook
from oss_plus.data_parallel.plan import ReducePlan
from oss_plus.runtime.trace import label

__all__ = [
    "GRAD_REQUIRES_GRAD",
    "GradReducer",
    "NOTHING_TO_REDUCE",
    "SECOND_BACKWARD",
]

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
#: Raised (as fairscale's SDP does) for a gradient that requires grad: double backward.
GRAD_REQUIRES_GRAD = (
    "ShardedDataParallel only works with gradients that don't require grad: a param's .grad "
    "requires grad (backward(create_graph=True), or a .grad that requires grad was set). "
    "Gradients are reduced to their owners and dropped elsewhere, so their graph cannot "
    "be kept (double backward is unsupported, as in fairscale). Drop such gradients "
    "(zero_grad(set_to_none=True)) and call backward() without create_graph"
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
        collective: ``"reduce"`` or ``"reduce_scatter"``.
        record: record the order the first backward produces the gradients in.
        find_unused: send the used flags with the buckets, so a param without a gradient on
            every rank keeps ``grad=None`` (else it gets the zero sum).
        give_piece: receives ``(param index, gradient of this rank's piece or None)`` for a
            param of a flat key cut by a range boundary that this rank holds a piece of
            (its ``.grad`` is dropped on every rank: a holder keeps only its range).
        replicate: hybrid sharding: the owner's reduced buckets are all-reduced across
            this group (:class:`~oss_plus.data_parallel.buckets.Buckets`).

    .. warning:: Collective: every rank of ``group`` must run the same backward passes.
    """

    RUNNING = _State.RUNNING

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
        replicate: Any = None,
    ) -> None:
        self.params = list(params)
        self.plan = plan
        self.group = group
        self.collective = collective
        self.find_unused = find_unused
        self._give_piece = give_piece
        self.buckets = Buckets(self.params, plan, group, wire, collective, find_unused, replicate)
        self._places: list[list[tuple[int, int]]] = [[] for _ in self.params]
        for b, bucket in enumerate(plan.buckets):
            for slot, index in enumerate(bucket.members):
                self._places[index].append((b, slot))
        self._split = [k for k, places in enumerate(self._places) if len(places) > 1]
        self._is_split = frozenset(self._split)
        self._held = self._held_pieces()
        self._counts = [len(b.members) for b in plan.buckets]
        #: Per param: 1 once its gradient is in a bucket in this reduction (reset in place).
        self.fired = bytearray(len(self.params))
        #: Per bucket: members still to come (reset in place).
        self.left = list(self._counts)
        #: A gradient that requires grad was seen (double backward): refused.
        self.graph_grad = False
        self.state = _State.IDLE
        self._pending = False
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(make_hook(self, i, self._places[i]))
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

    def _held_pieces(self) -> list[tuple[int, tuple[int, int], torch.Tensor]]:
        """(param, its place, view of this rank's range) of every cut param this rank holds
        a piece of."""
        held = []
        for index in self._split:
            for b, slot in self._places[index]:
                receive = self.buckets.receive[b]
                if receive is not None:
                    held.append((index, (b, slot), receive[slot]))
        return held

    def _recorder_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def record(_: torch.Tensor) -> None:
            if self.state is _State.RUNNING:
                self._seen.append(index)

        return record

    def _reset(self) -> None:
        self.buckets.reset()
        self.left[:] = self._counts
        self.fired[:] = bytes(len(self.fired))
        self._unused: dict[int, list[int]] = {}  # bucket -> slots with no local gradient
        #: Owned transient buckets' members with no local gradient: (index, place, sum).
        self._deferred: list[tuple[int, tuple[int, int], torch.Tensor]] = []

    def remove(self) -> None:
        """Detach the hooks (the reducer is being replaced)."""
        for handle in self._handles + self._recorders:
            handle.remove()
        self._handles, self._recorders = [], []

    # ----------------------------------------------------------------- pass control
    def start_pass(self, reduce: bool) -> None:
        """Called at every forward: the next backward reduces iff ``reduce``."""
        if self.state is not _State.IDLE or self._pending:
            self._reset()
        self.state = _State.ARMED if reduce else _State.IDLE
        self._pending = True

    def quiet(self) -> None:
        """Called at a forward that must not reduce (eval mode, no_grad): a backward through
        it leaves gradients local. A training forward still waiting for its backward stays
        armed."""
        if self.state is _State.DONE:
            self.state = _State.IDLE

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
        if not self._pending or self.state is _State.RUNNING:
            raise RuntimeError(NOTHING_TO_REDUCE)
        self._reset()
        self._finish()

    def begin(self) -> bool:
        """First hook of a backward: start reducing if armed. Returns whether to reduce."""
        if self.state is _State.IDLE:
            return False
        if self.state is _State.DONE:
            raise RuntimeError(SECOND_BACKWARD)
        self.state = _State.RUNNING
        Variable._execution_engine.queue_callback(self._finish)
        return True

    # ----------------------------------------------------------------- end of backward
    def _take_results(self) -> None:
        """Owner of transient buckets: the sums into its grads (unused: deferred)."""
        buckets = self.buckets
        for b, sums in buckets.results:
            unused = self._unused.get(b, ())
            members = self.plan.buckets[b].members
            grads, values = [], []
            for slot, (param, value) in enumerate(zip(buckets.members[b], sums)):
                if slot in unused:
                    self._deferred.append((members[slot], (b, slot), value))
                elif buckets.flat[b]:
                    if len(self._places[members[slot]]) == 1:  # whole: .grad is the view
                        param.grad = value
                elif param.grad is not None:
                    grads.append(param.grad)
                    values.append(value)
            if grads:
                torch._foreach_copy_(grads, values)
        buckets.results = []

    @torch.no_grad()
    def _fill_missing(self) -> None:
        """End of backward: complete the buckets whose hooks did not all fire."""
        for index in self._split:  # cut params first: their pieces are in several buckets
            param = self.params[index]
            if not self.fired[index] and param.grad is not None:  # accumulated (no_sync)
                self.fired[index] = 1
                places = self._places[index]
                spans = [self.plan.buckets[b].spans[s] for b, s in places]
                copy_pieces(self, param, places, spans)
        buckets = self.buckets
        for b, left in enumerate(self.left):
            if left == 0:
                continue
            views = buckets.views[b]
            for slot, index in enumerate(self.plan.buckets[b].members):
                if self.fired[index]:
                    continue
                param = self.params[index]
                if param.grad is None or index in self._is_split:
                    self._unused.setdefault(b, []).append(slot)
                    (views or buckets.open[b] or buckets.staged(b))[slot].zero_()
                    continue
                self.fired[index] = 1  # accumulated earlier (no_sync): counts as used
                if views is None:
                    keep = buckets.owned[b] and not buckets.flat[b]
                    _stage(buckets.open[b] or buckets.staged(b), slot, param, keep)
                elif param.grad is not views[slot]:
                    views[slot].copy_(param.grad)
                    param.grad = views[slot]
            if buckets.tails[b]:
                buckets.set_flags(b, [self.fired[i] for i in self.plan.buckets[b].members])
            self.left[b] = 0
        buckets.mark_all_full()

    def _read_flags(self) -> dict[tuple[int, int], bool] | None:
        """Whether some rank had a gradient, per (bucket, slot) of the owned buckets with a
        member this rank had none for: their summed flags, in one host read (None when
        there are none)."""
        sums = self.buckets.flag_sums
        if not sums:
            return None
        order = sorted(sums)
        device = sums[order[0]].device
        values = torch.cat([sums[b].to(device, torch.float32) for b in order]).tolist()
        places = [(b, slot) for b in order for slot in range(sums[b].numel())]
        return {place: value > 0 for place, value in zip(places, values)}

    def _settle_unused(self, anywhere: dict[tuple[int, int], bool] | None) -> None:
        """Owner, for params it had no gradient for: a gradient iff some rank had one (with
        ``anywhere`` None, unknown: the sum, zeros if no rank had one, as fairscale)."""
        for b, slots in self._unused.items():
            views = self.buckets.views[b]
            if views is None or not self.buckets.owned[b]:
                continue  # transient: in self._deferred
            for slot in slots:
                index = self.plan.buckets[b].members[slot]
                if index in self._is_split:
                    continue  # handed over below
                used = anywhere is None or anywhere[(b, slot)]
                self.params[index].grad = views[slot] if used else None
        for index, place, reduced in self._deferred:
            if index in self._is_split:
                continue
            param = self.params[index]
            used = anywhere is None or anywhere[place]
            param.grad = reduced.to(param.dtype, copy=True) if used else None

    def _hand_pieces(self, anywhere: dict[tuple[int, int], bool] | None) -> None:
        """Each cut param this rank holds a piece of: hand its range's sum to the optimizer
        (None when no rank had a gradient for it)."""
        if not self._held:
            return
        assert self._give_piece is not None, "a cut param needs give_piece"
        for index, place, piece in self._held:
            used = self.fired[index] or anywhere is None or anywhere[place]
            self._give_piece(index, piece if used else None)

    def _finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, settle unused."""
        with label("oss_plus::sdp::flush"):
            buckets = self.buckets
            if buckets.next < len(buckets.groups):
                self._fill_missing()
                buckets.launch_ready()
            buckets.complete_all()
            self._take_results()
            anywhere = self._read_flags()  # the one host read, only when needed
            self._settle_unused(anywhere)
            self._hand_pieces(anywhere)
            self._unused, self._deferred = {}, []
            if self._recorders and self._seen:  # the first reducing backward: keep its order
                self.observed = list(dict.fromkeys(self._seen))
                for handle in self._recorders:
                    handle.remove()
                self._recorders = []
            self.state = _State.DONE
            self._pending = False
            if self.graph_grad:
                raise RuntimeError(GRAD_REQUIRES_GRAD)


def _stage(staged: list[torch.Tensor], slot: int, param: torch.Tensor, keep: bool) -> None:
    """Copy ``param``'s gradient into its slot of a transient bucket; drop it unless
    this rank receives the sum into it."""
    grad = param.grad
    assert grad is not None
    staged[slot].copy_(grad.detach() if grad.requires_grad else grad)
    if not keep:
        param.grad = None  # copied: free it now
