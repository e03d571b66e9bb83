"""The engine of the overlapped step: :class:`DDPOverlap` and its two entry points.

See :mod:`oss_plus.overlap` for the schedules and why every collective is issued from the
hook (the autograd thread) in bucket order.
"""

# No ``from __future__ import annotations``: DDP inspects the annotations of the hook it is
# given (``DDPOverlap.hook``) and accepts only the real objects, not strings.
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from oss_plus.optimizer import OSS
from oss_plus.overlap.ddp import (
    CommHook,
    check_pairing,
    ddp_reduce_hook,
    grad_views,
    reduce_bucket,
)
from oss_plus.overlap.layout import Entry, OverlapSync
from oss_plus.overlap.plan import owner_pieces
from oss_plus.planning.plan import ShardPlan
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label
from oss_plus.state.index import copy_hyper
from oss_plus.wire.sync import Pending

__all__ = ["PARAMS_CHANGED", "DDPOverlap", "Gate", "Planner", "overlap_hook", "overlap_with_ddp"]

logger = logging.getLogger(__name__)

#: Decides, per bucket, whether the overlapped step is active yet (torch's warm-up).
Gate = Callable[[DistributedDataParallel, dist.GradBucket], bool]
#: Plans one DDP bucket: ``(bucket index, params) -> [(owner, positions)]``.
Planner = Callable[[int, Sequence[torch.Tensor]], list[tuple[int, list[int]]]]
#: A tensor given to a collective, with its use count from before (for ``await_release``).
Held = tuple[torch.Tensor, int]

#: Raised at the first bucket of an iteration when params or their trainability changed.
PARAMS_CHANGED = (
    "the optimizer's params or their requires_grad changed after the overlapped step was set "
    "up: DDP's gradient buckets cannot follow such a change; build a new DDP and optimizer"
)


class DDPOverlap:
    """Runs an optimizer's sharded step inside a DDP communication hook (see module doc).

    Use :func:`overlap_with_ddp` or :func:`overlap_hook`; the torch adapter builds one with
    torch's warm-up gate and bucket-based partition.

    Args:
        hook: the communication hook doing the reduction (e.g. ``allreduce_hook``).
        ddp: the DDP model.
        optimizer: an :class:`oss_plus.OSS` over the DDP model's params, same ranks.
        interleaved: step each bucket as soon as it is reduced (else after the last one).
        planner: who steps what in each bucket (default: the optimizer's own owners).
        gate: returns False while the step must not run yet (default: always runs).
        params_changed: message of the RuntimeError raised when params or their
            trainability changed.
    """

    def __init__(
        self,
        hook: CommHook,
        ddp: DistributedDataParallel,
        optimizer: OSS,
        *,
        interleaved: bool = False,
        planner: Planner | None = None,
        gate: Gate | None = None,
        params_changed: str = PARAMS_CHANGED,
    ) -> None:
        check_pairing(ddp, optimizer)
        self.inner_hook = hook
        self.interleaved = interleaved
        self.optimizer = optimizer
        self._ddp = weakref.ref(ddp)
        self._planner = planner or self._by_owner
        self._gate = gate
        self._params_changed = params_changed
        self._snapshot = self._describe()
        self._plan_seen: ShardPlan | None = None
        self._owner_of: dict[int, int] = {}
        self._lock = threading.Lock()
        self._lag = 0 if dist.get_backend(optimizer.group) == dist.Backend.NCCL else 1
        self._pending: list[tuple[dist.GradBucket, Entry, torch.futures.Future[Any]]] = []
        self._stepped: list[tuple[Entry, torch.futures.Future[Any]]] = []
        self._works: list[Pending] = []
        self._held: list[Held] = []
        self._warmup: list[tuple[torch.futures.Future[Any], list[Held]]] = []
        self._sent: list[Entry] = []
        self._issued = 0
        self._wire: torch.dtype | None = None
        self._error: Exception | None = None

    def _describe(self) -> list[tuple[int, bool]]:
        return [(id(p), p.requires_grad) for p in self.optimizer.flat_params()]

    # ----------------------------------------------------------------- the hook
    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The communication hook to register with ``ddp.register_comm_hook``.

        ``state=None`` stands for DDP's own process group (torch's default hooks would
        reduce over WORLD, wrong and hanging for DDP over a subgroup).

        .. warning:: Collective: DDP calls it on every rank of the group, bucket by bucket.
        """
        ddp = self._ddp()
        assert ddp is not None, "the DDP model of this hook was deleted"
        fut, held = self._reduce(ddp.process_group if state is None else state, bucket)
        if self._gate is not None and not self._gate(ddp, bucket):
            self._warm_up(bucket, fut, held)
            return fut
        index = bucket.index()
        if index == 0:
            self._begin()
        self._held += held
        entry = self._layout().entry(
            index, bucket.parameters(), lambda ps: self._planner(index, ps)
        )
        if self.interleaved:
            return self._interleave(bucket, entry, fut)
        self._pending.append((bucket, entry, fut))
        if bucket.is_last():
            self._step_all()
        return fut

    def _reduce(
        self, group: Any, bucket: dist.GradBucket
    ) -> tuple[torch.futures.Future[Any], list[Held]]:
        """Start the bucket's reduction; with :func:`ddp_reduce_hook`, also return what its
        all-reduce holds (another hook's collectives are its own: not waited for)."""
        if self.inner_hook is ddp_reduce_hook:
            return reduce_bucket(group, bucket)
        return self.inner_hook(group, bucket), []

    def _warm_up(
        self, bucket: dist.GradBucket, fut: torch.futures.Future[Any], held: list[Held]
    ) -> None:
        """An iteration the gate keeps from stepping only reduces: at its last bucket, wait
        for the reductions and for gloo's release of their tensors."""
        if held:
            self._warmup.append((fut, held))
        if not bucket.is_last():
            return
        warmup, self._warmup = self._warmup, []
        for reduced, _ in warmup:
            reduced.wait()
        self._release([h for _, hs in warmup for h in hs])

    def _release(self, held: list[Held]) -> None:
        """Return once gloo's worker dropped every tensor of ``held`` (whose works are
        done and no longer referenced here): see :func:`oss_plus.runtime.dist.await_release`."""
        _dist.await_release([t for t, _ in held], [c for _, c in held], self.optimizer.group)

    def _by_owner(self, index: int, params: Sequence[torch.Tensor]) -> list[tuple[int, list[int]]]:
        """The core's plan: each owner steps its own params of the bucket."""
        if self._plan_seen is not self.optimizer.plan:
            self._plan_seen = self.optimizer.plan
            self._owner_of = {id(p): r for p, r in self.optimizer.param_to_rank.items()}
        return owner_pieces([self._owner_of.get(id(p)) for p in params])

    def _layout(self) -> OverlapSync:
        sync = self.optimizer.sync
        if isinstance(sync, OverlapSync):
            return sync
        self.optimizer.install_sync(lambda: OverlapSync(self.optimizer.group))
        return self.optimizer.sync  # type: ignore[return-value]

    def _begin(self) -> None:
        """First bucket of an iteration: checks, fresh per-iteration state, hyperparams in."""
        opt = self.optimizer
        if self._describe() != self._snapshot:
            raise RuntimeError(self._params_changed)
        moved = self._plan_seen is not None and self._plan_seen is not opt.plan
        sync = opt.sync
        if not isinstance(sync, OverlapSync) or not sync.is_intact() or moved:
            opt.install_sync(lambda: OverlapSync(opt.group))
        opt.drop_consolidated()
        self._reset()
        self._wire = opt.wire_dtype
        copy_hyper(opt.param_groups, opt.optim.param_groups)

    def _reset(self) -> None:
        self._pending, self._stepped, self._works, self._sent = [], [], [], []
        self._issued, self._error, self._held = 0, None, []

    def _end(self) -> None:
        """After the last bucket: wait for the broadcasts, raise on every rank if any rank's
        step raised (:meth:`oss_plus.wire.sync.BucketSync.settle`), hyperparams out."""
        opt = self.optimizer
        error, sent, held = self._error, self._sent, self._held
        try:
            with label("oss_plus::overlap.wait"):
                _wait_all(self._works)
        finally:
            self._reset()
        self._release(held)
        self._layout().settle(error, sent)
        copy_hyper(opt.optim.param_groups, opt.param_groups)

    # ----------------------------------------------------------------- the two schedules
    def _step_all(self) -> None:
        """torch's ``hook_with_zero_step``: in bucket order, wait, step, start broadcasts."""
        for bucket, entry, fut in self._pending:
            value = fut.wait()
            self._step(entry, bucket, value)
            self._broadcast(entry)
        self._end()

    def _broadcast(self, entry: Entry) -> None:
        failed = self._error is not None
        started = self._layout().broadcast(entry, self._wire, failed)
        self._works += started
        self._held += [h for p in started for h in p.held]
        self._sent.append(entry)

    def _interleave(
        self, bucket: dist.GradBucket, entry: Entry, fut: torch.futures.Future[Any]
    ) -> torch.futures.Future[torch.Tensor]:
        """Step in a ``then`` callback; issue broadcasts from here, in bucket order."""
        stepped = fut
        if entry.owned:
            stepped = fut.then(functools.partial(_step_done, weakref.ref(self), entry, bucket))
        self._stepped.append((entry, stepped))
        self._issue(len(self._stepped) - self._lag)
        if bucket.is_last():
            self._issue(len(self._stepped))
            self._end()
        return stepped

    def _issue(self, upto: int) -> None:
        while self._issued < upto:
            entry, stepped = self._stepped[self._issued]
            stepped.wait()
            self._broadcast(entry)
            self._issued += 1

    # ----------------------------------------------------------------- the local step
    def _step(self, entry: Entry, bucket: dist.GradBucket, value: Any) -> None:
        """Step the params of ``entry`` this rank owns with the reduced gradients.

        The inner optimizer sees only those params (its groups are narrowed for the call)
        and their ``.grad`` temporarily point at the reduced values; both are restored. An
        exception is kept (and later buckets are not stepped): the pieces still travel,
        carrying the failure, and :meth:`_end` raises it on every rank.
        """
        if not entry.owned or self._error is not None:
            return
        grads = grad_views(bucket, value)
        with self._lock, label("oss_plus::overlap.step"):
            inner = self.optimizer.optim
            narrowed = entry.groups_for(inner)
            saved = [g["params"] for g in inner.param_groups]
            previous = [p.grad for p in entry.owned]
            try:
                self._layout().transport.restore(self._wire, entry.pieces)  # exact values back
                for group, params in zip(inner.param_groups, narrowed):
                    group["params"] = params
                for p, position in zip(entry.owned, entry.positions):
                    p.grad = grads[position]
                inner.step()
            except Exception as exc:  # noqa: BLE001 - raised on every rank by _end
                self._error = exc
            finally:
                for group, params in zip(inner.param_groups, saved):
                    group["params"] = params
                for p, grad in zip(entry.owned, previous):
                    p.grad = grad


def _wait_all(works: Sequence[Pending]) -> None:
    """Wait for every work (in a frame of its own, so no loop variable keeps a handle)."""
    for finish in works:
        finish()


def _step_done(
    engine: "weakref.ReferenceType[DDPOverlap]",
    entry: Entry,
    bucket: dist.GradBucket,
    fut: torch.futures.Future[Any],
) -> Any:
    """The ``then`` callback of the interleaved schedule: step, pass the reduced value on.

    It holds the engine weakly: gloo destroys callbacks on its worker thread, which must
    never drop the last reference to the optimizer (and so to its process group, whose
    destructor joins that very thread: ``std::system_error: Resource deadlock avoided``).
    """
    value = fut.value()
    owner = engine()
    if owner is not None:
        owner._step(entry, bucket, value)
    return value


def overlap_hook(
    hook: CommHook,
    ddp: DistributedDataParallel,
    optimizer: OSS,
    *,
    interleaved: bool = False,
) -> CommHook:
    """Return ``hook`` extended with ``optimizer``'s sharded step, for ``register_comm_hook``.

    Args:
        hook: the reduction hook, e.g. :func:`ddp_reduce_hook` (DDP's own averaging),
            ``allreduce_hook`` or ``bf16_compress_hook``.
        ddp: the DDP model (over the same ranks as ``optimizer.group``).
        optimizer: an :class:`oss_plus.OSS` holding every trainable param of ``ddp``.
        interleaved: step each bucket as soon as it is reduced (else after the last one).

    Returns:
        The hook; pass it to ``ddp.register_comm_hook(state, hook)`` (``state=None`` means
        DDP's process group). Then never call ``optimizer.step()``.

    Raises:
        TypeError: ``optimizer`` is not an OSS.
        ValueError: different ranks or params in ``ddp`` and ``optimizer``.

    Example:
        >>> ddp.register_comm_hook(None, overlap_hook(ddp_reduce_hook, ddp, opt))  # doctest: +SKIP

    .. warning:: Collective: the hook runs on every rank of the group inside ``backward()``.
    """
    return DDPOverlap(hook, ddp, optimizer, interleaved=interleaved).hook


def overlap_with_ddp(
    ddp: DistributedDataParallel,
    optimizer: OSS,
    hook: CommHook = ddp_reduce_hook,
    state: Any = None,
    *,
    interleaved: bool = False,
) -> DDPOverlap:
    """Move ``optimizer``'s step into ``ddp``'s backward: register the overlapping hook.

    After this call every ``backward()`` through ``ddp`` reduces the gradients, steps the
    shard of each bucket as soon as it is reduced and broadcasts it; the loop calls no
    ``step()``. Hyperparameter changes (LR schedulers) apply from the next backward. Zero the
    gradients every iteration as usual. DDP allows one comm hook: call this once.

    Args:
        ddp: the DDP model (over the same ranks as ``optimizer.group``).
        optimizer: an :class:`oss_plus.OSS` holding every trainable param of ``ddp``.
        hook: the reduction hook (default :func:`ddp_reduce_hook`: exactly what DDP does
            without a hook, so results equal plain DDP + ``optimizer.step()``).
        state: the hook's state (default: DDP's process group).
        interleaved: step each bucket as soon as it is reduced (else after the last one).

    Returns:
        The :class:`DDPOverlap` driving the hook.

    Raises:
        TypeError: ``optimizer`` is not an OSS.
        ValueError: different ranks or params in ``ddp`` and ``optimizer``.
        RuntimeError: ``ddp`` already has a comm hook (raised by DDP).

    Example:
        >>> opt = OSS(ddp.parameters(), optim=AdamW, group=pg, lr=1e-3)  # doctest: +SKIP
        >>> overlap_with_ddp(ddp, opt)  # doctest: +SKIP
        >>> opt.zero_grad(); ddp(x).sum().backward()  # doctest: +SKIP

    .. warning:: Collective: call on every rank of the group; every backward is collective.
    """
    engine = DDPOverlap(hook, ddp, optimizer, interleaved=interleaved)
    ddp.register_comm_hook(ddp.process_group if state is None else state, engine.hook)
    return engine
