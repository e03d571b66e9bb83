"""torch's ``ddp_zero_hook`` for :class:`oss_plus.compat.torch.ZeroRedundancyOptimizer`.

``hook_with_zero_step`` and ``hook_with_zero_step_interleaved`` have the signatures of
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` and work with
``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)``: register the returned hook with
``ddp.register_comm_hook(None, hook)`` and call no ``step()``. The machinery is
:class:`oss_plus.overlap.DDPOverlap`; this module adds torch's behaviour on top:

* the warm-up (:class:`TorchWarmup`): nothing is updated until DDP has rebuilt its buckets
  and one more iteration has recorded them: the first 2 iterations (3 with
  ``static_graph=True``) only reduce gradients, exactly as torch;
* the partition by DDP bucket (:func:`plan_overlap`): bucket ``b`` to rank
  ``b % world_size``, or cut across ranks with ``shard_buckets=True``, as torch.

Unlike torch, gloo is supported (torch refuses it: its interleaved hook does hang there; see
:mod:`oss_plus.overlap` for why and how it is avoided), the ranks are group-local (torch
mixes global and group ranks, wrong for a subgroup), and ``state=None`` means DDP's group.

Example:
    >>> zero = ZeroRedundancyOptimizer(  # doctest: +SKIP
    ...     ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
    ... )
    >>> hook = hook_with_zero_step(allreduce_hook, ddp, zero)  # doctest: +SKIP
    >>> ddp.register_comm_hook(None, hook)  # doctest: +SKIP
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from oss_plus.overlap import CommHook, DDPOverlap
from oss_plus.overlap.layout import OverlapSync
from oss_plus.overlap.plan import Assignment, local_order, torch_assignments
from oss_plus.planning.partition import Rule
from oss_plus.planning.plan import ShardPlan

if TYPE_CHECKING:
    from oss_plus.optimizer import OSS


class ZeroRedundancyOptimizer(Protocol):
    """What the hooks use of :class:`oss_plus.compat.torch.ZeroRedundancyOptimizer` (typed
    here, so that this module imports nothing above it)."""

    _overlap: Any
    group: Any
    process_group: Any
    rank: int
    world_size: int

    def flat_params(self) -> list[torch.Tensor]:
        """Every param in flat-index order."""

    def install_sync(self, make: Callable[[], Any] | None = None) -> None:
        """Install a parameter sync."""

    def repartition(self, plan: ShardPlan | None = None, *, pin: bool = False) -> None:
        """Adopt a plan."""


__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

logger = logging.getLogger(__name__)

#: torch's messages for the cases it does not support.
NOT_OVERLAP = (
    "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this "
    "hook properly"
)
TRAINABILITY_CHANGED = (
    "ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not support changing "
    "parameter trainability at run time"
)
UNKNOWN_PARAM = (
    "Passing a new parameter in `params_per_rank` that was not passed into the "
    "ZeroRedundancyOptimizer constructor"
)
#: Raised when DDP's buckets differ from those recorded at initialization.
BUCKETS_CHANGED = (
    "DDP's gradient bucket {index} differs from the one recorded when the "
    "ZeroRedundancyOptimizer (overlap_with_ddp=True) was initialized; DDP rebuilds its buckets "
    "only once, so this DDP model is not the one the optimizer was set up with"
)


class Status(enum.IntEnum):
    """torch's ``_OverlapStatus``."""

    UNINITIALIZED = 0
    DDP_HAS_REBUILT_BUCKETS = 1
    INITIALIZED = 2


@dataclass(frozen=True)
class OverlapPlan:
    """The partition by DDP bucket, fixed at initialization.

    Attributes:
        assignments: torch's bucket assignments, in the order torch makes them.
        bucket_ids: ``id()`` of each bucket's params, by bucket index.
        owners: owner (group-local rank) of every param, by flat index.
        local: per rank, the flat indices it owns, in its local optimizer's order.
    """

    assignments: tuple[Assignment, ...]
    bucket_ids: tuple[tuple[int, ...], ...]
    owners: tuple[int, ...]
    local: tuple[tuple[int, ...], ...]

    def pieces(self, index: int, params: Sequence[torch.Tensor]) -> list[tuple[int, list[int]]]:
        """Return ``(owner, positions)`` for DDP bucket ``index`` (a :data:`Planner`).

        Raises:
            RuntimeError: the bucket is not the one recorded.
        """
        ids = tuple(id(p) for p in params)
        if index >= len(self.bucket_ids) or ids != self.bucket_ids[index]:
            raise RuntimeError(BUCKETS_CHANGED.format(index=index))
        return [
            (a.owner, list(range(a.start, a.stop))) for a in self.assignments if a.bucket == index
        ]


def plan_overlap(
    flat: Sequence[torch.Tensor],
    buckets: Sequence[Sequence[torch.Tensor]],
    world_size: int,
    shard_buckets: bool,
) -> OverlapPlan:
    """Partition ``flat`` by DDP bucket as torch does.

    Params in no bucket (frozen when DDP was built) go to the least loaded rank; they are
    never stepped (torch leaves them out of every rank's partition).

    Args:
        flat: the optimizer's params, in flat order.
        buckets: DDP's buckets, each its params in bucket order.
        world_size: ranks in the group.
        shard_buckets: cut buckets across ranks.

    Raises:
        ValueError: a bucket holds a param the optimizer does not.
    """
    index_of = {id(p): i for i, p in enumerate(flat)}
    if any(id(p) not in index_of for bucket in buckets for p in bucket):
        raise ValueError(UNKNOWN_PARAM)
    assignments = torch_assignments(
        [[p.numel() for p in b] for b in buckets], world_size, shard_buckets
    )
    owners: list[int | None] = [None] * len(flat)
    loads = [0] * world_size
    for a in assignments:
        for position in range(a.start, a.stop):
            p = buckets[a.bucket][position]
            owners[index_of[id(p)]] = a.owner
            loads[a.owner] += p.numel()
    for i, p in enumerate(flat):
        if owners[i] is None:
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            owners[i], loads[rank] = rank, loads[rank] + p.numel()
    bucketed = {id(p) for b in buckets for p in b}
    local = tuple(
        tuple(index_of[id(buckets[b][pos])] for b, pos in local_order(assignments, r))
        + tuple(i for i, p in enumerate(flat) if owners[i] == r and id(p) not in bucketed)
        for r in range(world_size)
    )
    return OverlapPlan(
        tuple(assignments),
        tuple(tuple(id(p) for p in b) for b in buckets),
        tuple(o for o in owners if o is not None),
        local,
    )


def init_overlap(
    zero: ZeroRedundancyOptimizer, buckets: list[list[torch.Tensor]], shard_buckets: bool
) -> None:
    """Partition ``zero`` by DDP bucket (torch's delayed initialization), moving any state.

    Called by the hook at the first bucket after the warm-up. State loaded before (by
    ``load_state_dict`` or ``oss_plus.load_checkpoint``) goes to the new owners; the inner
    optimizer is rebuilt over the new shard (one param group) and the params are laid out
    by DDP bucket as the buckets arrive.

    .. warning:: Collective: runs on every rank of ``zero.process_group`` (inside the hook).
    """
    flat = zero.flat_params()
    plan = plan_overlap(flat, buckets, zero.world_size, shard_buckets)
    zero._overlap = plan
    shard = ShardPlan(
        world_size=zero.world_size,
        rule=Rule.TORCH,
        group_sizes=(len(flat),),
        owners=plan.owners,
        local=tuple((tuple(view),) for view in plan.local),
        numels=tuple(p.numel() for p in flat),
        trainable=tuple(p.requires_grad for p in flat),
    )
    zero.repartition(shard, pin=True)
    # pieces are laid out as DDP's buckets arrive
    zero.install_sync(lambda: OverlapSync(zero.group))
    logger.info(
        "overlap_with_ddp initialized: %d DDP buckets, %d assignments, %d params on rank %d",
        len(buckets),
        len(plan.assignments),
        len(plan.local[zero.rank]),
        zero.rank,
    )


class TorchWarmup:
    """torch's delayed initialization, as a :data:`oss_plus.overlap.Gate`.

    Until DDP has rebuilt its buckets the hook only reduces. In the first iteration after
    the rebuild each bucket's params are recorded (still no update). At the first bucket of
    the next iteration the optimizer is initialized from the recorded buckets and the step
    runs from then on. So the first 2 iterations (3 with ``static_graph=True``, whose rebuild
    comes one iteration later) do not update the params, exactly as torch.
    """

    def __init__(self, zero: ZeroRedundancyOptimizer, shard_buckets: bool) -> None:
        self.zero = zero
        self.shard_buckets = shard_buckets
        self.status = Status.INITIALIZED if zero._overlap is not None else Status.UNINITIALIZED
        self.recorded: list[list[torch.Tensor]] = []

    def __call__(self, ddp: DistributedDataParallel, bucket: Any) -> bool:
        if self.status is Status.INITIALIZED:
            return True
        if not ddp._has_rebuilt_buckets:
            return False
        self.status = Status.DDP_HAS_REBUILT_BUCKETS
        if bucket.index() == 0 and self.recorded:
            init_overlap(self.zero, self.recorded, self.shard_buckets)
            self.recorded = []
            self.status = Status.INITIALIZED
            return True
        self.recorded.append(list(bucket.parameters()))
        return False


def _plan_of(zero: ZeroRedundancyOptimizer) -> OverlapPlan:
    assert zero._overlap is not None, "the overlapped step ran before initialization"
    return zero._overlap


def _make(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    interleaved: bool,
) -> CommHook:
    if not getattr(zero, "_overlap_with_ddp", False):
        raise ValueError(NOT_OVERLAP)
    engine = DDPOverlap(
        hook,
        ddp,
        cast("OSS", zero),  # the adapter is an OSS
        interleaved=interleaved,
        planner=lambda index, params: _plan_of(zero).pieces(index, params),
        gate=TorchWarmup(zero, shard_buckets),
        params_changed=TRAINABILITY_CHANGED,
    )
    return engine.hook


#: The part of the two hooks' docstrings they share (appended to each).
_HOOK_DOC = """
    Args:
        hook: the reduction hook (e.g. ``allreduce_hook``); ``state=None`` at registration
            means DDP's process group.
        ddp: the DDP model.
        zero: a ``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` over ``ddp``'s params.
        shard_buckets: cut each DDP bucket across ranks (else each bucket goes to one rank).

    Returns:
        The hook for ``ddp.register_comm_hook(None, ...)``.

    Raises:
        ValueError: ``zero`` was built with ``overlap_with_ddp=False``, or ``ddp`` and
            ``zero`` hold different params or ranks.
        Exception: from ``backward()`` on every rank, when one rank's step raised (see
            :mod:`oss_plus.overlap`).

    .. warning:: The first 2 iterations (3 with ``static_graph=True``) do not update the
       params, as in torch (see :class:`TorchWarmup`).

    .. warning:: Collective: the hook runs on every rank of the group inside ``backward()``.
    """


def hook_with_zero_step(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> CommHook:
    """Return ``hook`` extended to run ``zero``'s step after the last bucket is computed.

    When the last gradient bucket is ready, each bucket in order: wait for its reduction,
    step the params this rank owns in it, start its broadcast; then wait for the broadcasts.
    The optimizer computation overlaps the reductions still in flight.
    """
    return _make(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> CommHook:
    """Return ``hook`` extended to step each bucket as soon as it is reduced.

    Each bucket's step runs in a callback of its reduction while backward continues; its
    broadcast is issued from the next bucket's hook (on NCCL at once), so every rank issues
    its collectives in the same order, which is what makes this work on gloo.
    """
    return _make(hook, ddp, zero, shard_buckets, interleaved=True)


for _hook in (hook_with_zero_step, hook_with_zero_step_interleaved):
    _hook.__doc__ = (_hook.__doc__ or "").rstrip() + "\n" + _HOOK_DOC
