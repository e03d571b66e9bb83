"""Keeping :class:`~oss_plus.data_parallel.ShardedDataParallel`'s reducer planned for the
current params and partitions (the forward-time checks).

A :class:`ReduceReplanner` owns the wrapper's :class:`~oss_plus.data_parallel.reducer.GradReducer`
and what its plan was made from (a :class:`~oss_plus.data_parallel.wiring.Watch`, the
module's buffers, the params' devices). Before each forward the wrapper asks it what
changed (:meth:`~ReduceReplanner.change`: a new partition of an optimizer, and, with
``auto_refresh_trainable``, params re-registered, re-allocated or (un)frozen), has it
re-plan (:meth:`~ReduceReplanner.replan`), adopt the order rank 0's first backward produced
the gradients in (:meth:`~ReduceReplanner.observed_order`, as DDP rebuilds its buckets),
and refuse gradients that require grad. It reads the wrapper's settings as arguments and
holds no reference to the wrapper.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from oss_plus.data_parallel import _validate
from oss_plus.data_parallel.plan import BucketCap
from oss_plus.data_parallel.reducer import GRAD_REQUIRES_GRAD, GradReducer
from oss_plus.data_parallel.wiring import Settings, Watch, build_reducer, plan_for
from oss_plus.optimizer import OSS
from oss_plus.planning.partition import Rule
from oss_plus.runtime import dist as _dist

__all__ = ["Change", "ReduceReplanner", "graph_grads"]

logger = logging.getLogger(__name__)


class Change(enum.Enum):
    """What :meth:`ReduceReplanner.change` found since the last plan."""

    NONE = "none"
    #: The partition or the params changed: re-plan the reduction.
    REPLAN = "replan"
    #: ``requires_grad`` changed: repartition the optimizers, then re-plan.
    TRAINABILITY = "trainability"


class ReduceReplanner:
    """The reducer of a wrapped module, re-planned when the params or the partition change.

    Args:
        module: the wrapped module.
        optimizers: the sharded optimizers that decide who owns each gradient.
        settings: the reduction settings the reducer is built with (group, wire,
            collective, bucket cap, unused-parameter flags, replicate group).
        refuse_at_forward: a gradient that requires grad was seen at construction on some
            rank: the first forward raises on every rank.
        cap: the first plan's bucket cap. find_unused: the first plan's
            ``find_unused_parameters``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[OSS],
        settings: Settings,
        refuse_at_forward: bool,
        cap: BucketCap,
        find_unused: bool,
    ) -> None:
        self.module, self.optimizers, self.settings = module, list(optimizers), settings
        self.refuse_at_forward = refuse_at_forward
        self.devices = [p.device for p in module.parameters()]
        self.reducer = self._build(cap, find_unused, None)
        self.buffers = list(module.buffers())
        self.watch = Watch(module, self.optimizers)
        self.refuse_at_forward |= graph_grads(module)  # fairscale checks at setup

    def _build(self, cap: BucketCap, find_unused: bool, order: list[int] | None) -> GradReducer:
        self.settings.bucket_numel = cap
        self.settings.find_unused = find_unused
        return build_reducer(self.module, self.optimizers, self.settings, order)

    def replan(self, cap: BucketCap, find_unused: bool, order: list[int] | None = None) -> None:
        """Rebuild the reduce plan and hooks from the optimizers' current partition (buckets
        in ``order``; without one, the next backward's order is recorded and followed)."""
        self.reducer.remove()
        self.reducer = self._build(cap, find_unused, order)
        self.buffers = list(self.module.buffers())
        self.watch = Watch(self.module, self.optimizers)
        self.refuse_at_forward |= graph_grads(self.module)  # fairscale checks at setup

    def change(self, auto_refresh: bool) -> Change:
        """What changed since the plan: the partition (a few identity checks); with
        ``auto_refresh``, also the params (C-level passes; see
        :class:`~oss_plus.data_parallel.wiring.Watch`). A re-allocation moves the flat
        rule's cut: its optimizers lay their sync out again here.

        Raises:
            ValueError: a param changed device after wrapping.
        """
        watch = self.watch
        if not auto_refresh:
            if watch.plans_changed():
                logger.info("the optimizer's partition changed: re-planning")
                return Change.REPLAN
            return Change.NONE
        if not watch.params_changed() and not watch.plans_changed():
            return Change.NONE
        self._check_devices()
        if watch.trainability_changed():
            return Change.TRAINABILITY
        if watch.addresses_changed():  # a dtype change moves the flat rule's cut
            for optimizer in self.optimizers:
                if optimizer.policy.rule is Rule.FLAT:
                    optimizer.install_sync()
        logger.info("the params or the optimizer's partition changed: re-planning")
        return Change.REPLAN

    def _check_devices(self) -> None:
        for (name, param), before in zip(self.module.named_parameters(), self.devices):
            if param.device != before:
                raise ValueError(
                    _validate.MODULE_MOVED.format(name=name, before=before, after=param.device)
                )

    def refuse_graph_grads(self) -> None:
        """Raise while a gradient requires grad (checked only after one was seen)."""
        at_start, self.refuse_at_forward = self.refuse_at_forward, False
        if at_start or graph_grads(self.module):
            raise RuntimeError(GRAD_REQUIRES_GRAD)
        self.reducer.graph_grad = False

    def observed_order(self, observed: list[int], cap: BucketCap) -> list[int] | None:
        """Once after a (re)plan, as DDP's bucket rebuild: agree on the order in which rank
        0's first backward produced the gradients; return it if the buckets change in that
        order (the caller re-plans in it), else None. One broadcast per group and one host
        read, at this forward only.

        .. warning:: Collective: call on every rank of the settings' groups.
        """
        count = len(self.reducer.params)
        order = torch.full((count,), -1, dtype=torch.int64)
        order[: len(observed)] = torch.tensor(observed, dtype=torch.int64)
        order = order.to(_dist.comm_device(self.settings.group))
        for group in (self.settings.group, self.settings.replicate):  # every replica alike
            if group is not None:
                dist.broadcast(order, src=_dist.global_rank(group, 0), group=group)
        agreed = [i for i in order.tolist() if i >= 0]
        self.reducer.observed = None
        plan = plan_for(self.module, self.optimizers, cap, agreed)[1]
        if plan == self.reducer.plan:
            return None
        logger.info("re-planning the buckets in the order backward produced the gradients")
        return agreed


def graph_grads(module: nn.Module) -> bool:
    """Whether a param of ``module`` has a ``.grad`` that requires grad (one pass)."""
    return any(p.grad is not None and p.grad.requires_grad for p in module.parameters())
