"""How ``OSS`` follows its params: :class:`Replanner`, owned by the optimizer.

It holds what the layout was built for and keeps the plan and the parameter sync in step
with the params: plan again by the policy (a plan pinned by :meth:`oss_plus.OSS.repartition`
keeps its owners while the groups do not change), adopt a plan agreed by every rank (the
state moves in :meth:`oss_plus.shard.LocalShard.adopt`), install a sync laid out for it
(:func:`oss_plus.sync.build_sync`, or the one a collaborator gives), and, before every step,
read what changed since (:class:`oss_plus.changes.ChangeDetector`: ``requires_grad``; the
sync's ``is_intact()``: re-allocated params).

A rank whose plan changed at a step does not repartition alone: it runs the sync unstepped
with :data:`~oss_plus.status.REPLAN` (:meth:`oss_plus.stepping.StepDriver.replan`) and the
ranks repartition together only when every rank sent it (``docs/design.md``, "When
requires_grad changes"). The consolidated state is the optimizer's: it drops it after every
call here that changes the plan or the sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from oss_plus import _params
from oss_plus.changes import ChangeDetector
from oss_plus.partition import Rule
from oss_plus.plan import ShardPlan, ShardPolicy
from oss_plus.shard import LocalShard
from oss_plus.stepping import StepDriver
from oss_plus.sync import BucketSync, build_sync

__all__ = ["Replanner"]

logger = logging.getLogger(__name__)


class Replanner:
    """The plan, the parameter sync laid out for it, and what follows the params' changes.

    Builds and installs the first sync (params laid out for ``shard.plan``).

    Args:
        shard: the optimizer's :class:`~oss_plus.shard.LocalShard` (its plan, its params).
        policy: the optimizer's :class:`~oss_plus.plan.ShardPolicy`.
        group: the optimizer's process group.
        driver: the optimizer's :class:`~oss_plus.stepping.StepDriver` (settles the last
            step first; runs the unstepped sync of a rank whose plan changed).
    """

    def __init__(
        self, shard: LocalShard, policy: ShardPolicy, group: Any, driver: StepDriver
    ) -> None:
        self.shard = shard
        self.policy = policy
        self.group = group
        self.driver = driver
        self.pinned = False  # repartition(pin=True): later plans keep its owners
        self.changes = ChangeDetector(shard.plan.world_size)
        self.sync: BucketSync = self.build()
        shard.targets.point(getattr(self.sync, "piece_view", None))
        self.changes.reset(shard.flat_params())

    def make_plan(self, keep: bool = False) -> ShardPlan:
        """Plan by the policy; with ``keep``, params already placed keep their owners (a
        pinned plan, :meth:`adopt` with ``pin``, is kept while the groups do not change)."""
        return self.shard.make_plan(self.policy, keep or self.pinned, self.pinned)

    def build(self) -> BucketSync:
        """The policy's sync over the params now, laid out for the current plan."""
        return build_sync(self.shard.flat_params(), self.shard.plan, self.policy, self.group)

    def adopt(self, plan: ShardPlan | None, pin: bool = False) -> None:
        """What :meth:`oss_plus.OSS.repartition` does but drop the consolidated state: agree
        on ``plan`` (default: :meth:`make_plan`), move the state, install the policy's sync.

        .. warning:: Collective: call on every rank of ``group`` with the same plan.
        """
        self.driver.settle()
        if plan is None:
            plan = self.make_plan()
        error: Exception | None = None
        try:
            groups = self.shard.param_groups
            plan.check_fits([len(g["params"]) for g in groups], self.shard.plan.world_size)
        except ValueError as exc:
            error = exc
        _params.agree_plan(plan, error, self.group)  # raises on every rank before any move
        self.pinned = pin or self.pinned
        self.shard.adopt(plan, self.group)
        self.install()

    def install(self, make: Callable[[], Any] | None = None) -> None:
        """What :meth:`oss_plus.OSS.install_sync` does but drop the consolidated state:
        release the sync, install ``make()`` (default: :meth:`build`; under the flat rule a
        moved cut is adopted first).

        .. warning:: Collective when ``make`` is: call on every rank of ``group``.
        """
        self.driver.settle()
        plan = self._new_cut() if make is None else None
        if plan is not None:
            self.adopt(plan)  # moves the state, then installs the sync
            return
        self.sync.release()
        self.sync = (make or self.build)()
        self.shard.targets.point(getattr(self.sync, "piece_view", None))
        self.changes.reset(self.shard.flat_params())

    def add_group(self) -> None:
        """Place the params of the groups' new last group: under the flat rule cut again
        and move the state; else on top of the current totals, every other owner kept.

        .. warning:: Collective: call on every rank of ``group`` with the same group.
        """
        if self.policy.rule is Rule.FLAT:  # the ranges move: cut again, move the state
            self.adopt(self.make_plan())
            return
        plan = self.make_plan(keep=True)
        _params.agree_plan(plan, None, self.group)  # the totals depend on trainability
        self.shard.add_group(plan)
        self.install()

    def _new_cut(self) -> ShardPlan | None:
        """Under the flat rule, the plan by the policy when it differs from the current one
        (the cut depends on the params' dtypes and devices); else None."""
        if self.policy.rule is not Rule.FLAT:
            return None
        plan = self.make_plan()
        return None if plan == self.shard.plan else plan

    def follow(self) -> ShardPlan | None:
        """Before the local step: return the plan to adopt together when this rank's plan
        changed (``requires_grad``; the flat rule's cut after a re-allocation: see
        :meth:`together`); params re-allocated otherwise get a new layout here (local:
        every rank's layout follows from the plan). None: the step goes on."""
        if self.changes.trainability_changed():
            return self.make_plan()
        if not self.sync.is_intact():
            plan = self._new_cut()
            if plan is not None:
                return plan
            logger.info("params were re-allocated (e.g. module.to()): rebuilding buckets")
            self.install()
        return None

    def together(self, plan: ShardPlan, wire: torch.dtype | None) -> bool:
        """This rank's plan changed: run the sync unstepped with
        :data:`~oss_plus.status.REPLAN` and read every rank's code now (the one host read, on
        this rare path only). When every rank sent it, adopt ``plan`` together (agreeing on
        it) and return True (the step goes on); else every rank raises
        :data:`~oss_plus.status.TRAINABILITY_DIFFERS` at the next check (the others stepped;
        this rank did not).

        .. warning:: Collective: call on every rank of ``group``, as its step's sync.
        """
        sync = self.sync
        if isinstance(sync, BucketSync) and not self.driver.replan(sync, wire):
            return False
        logger.info("trainable params changed on every rank: repartitioning")
        self.adopt(plan)
        return True
