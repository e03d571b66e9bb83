"""How ``OSS`` follows its params: :class:`Replanner`, owned by the optimizer.

It holds what the layout was built for and keeps the plan and the parameter sync in step
with the params: plan again by the policy (a plan pinned by :meth:`oss_plus.OSS.repartition`
keeps its owners while the groups do not change), adopt a plan agreed by every rank (the
state moves in :meth:`oss_plus.step.shard.LocalShard.adopt`), install a sync laid out for it
(:func:`oss_plus.wire.factory.build_sync`, or the one a collaborator gives), and, before
every step, read what changed since (:class:`oss_plus.wire.changes.ChangeDetector`:
``requires_grad``; the sync's ``is_intact()``: re-allocated params).

A rank whose plan changed at a step does not repartition alone: it runs the sync unstepped
with :data:`~oss_plus.wire.status.REPLAN` (:meth:`oss_plus.step.driver.StepDriver.replan`) and the
ranks repartition together only when every rank sent it (``docs/design.md``, "When
requires_grad changes"). The consolidated state is the optimizer's: it drops it after every
call here that changes the plan or the sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from oss_plus.planning.partition import Rule
from oss_plus.planning.plan import ShardPlan
from oss_plus.planning.policy import ShardPolicy
from oss_plus.state.extras import Extras
from oss_plus.state.index import ParamState
from oss_plus.step import params as _params
from oss_plus.step.driver import StepDriver
from oss_plus.step.shard import LocalShard
from oss_plus.wire.changes import ChangeDetector
from oss_plus.wire.factory import build_sync
from oss_plus.wire.main.region import MAIN_KEY, apply_exact, split_main
from oss_plus.wire.sync import BucketSync

__all__ = ["Replanner"]

logger = logging.getLogger(__name__)

#: Raised for a main-copy entry (:data:`oss_plus.wire.main.region.MAIN_KEY`) that does not fit.
BAD_MAIN = (
    "state[{index}]['oss_plus.main'] (the param's exact values under a compressed wire) has "
    "shape {got} but must have the shape of param {index}, {shape} (or the number of "
    "elements of this rank's piece of it): the state belongs to another model; drop the "
    "'oss_plus.main' entries to load the rest"
)


def _shape_of(value: object) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


class Replanner:
    """The plan, the parameter sync laid out for it, and what follows the params' changes.

    Builds and installs the first sync (params laid out for ``shard.plan``).

    Args:
        shard: the optimizer's :class:`~oss_plus.step.shard.LocalShard` (its plan, its params).
        policy: the optimizer's :class:`~oss_plus.planning.plan.ShardPolicy`.
        group: the optimizer's process group.
        driver: the optimizer's :class:`~oss_plus.step.driver.StepDriver` (settles the last
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
        carried = self.main_values()  # the exact values move with the state
        self.install(carried=self.shard.adopt(plan, self.group, carried))

    def install(
        self,
        make: Callable[[], Any] | None = None,
        carried: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """What :meth:`oss_plus.OSS.install_sync` does but drop the consolidated state:
        release the sync, install ``make()`` (default: :meth:`build`; under the flat rule a
        moved cut is adopted first). The exact values of what this rank sent compressed
        (``carried``, default: the old sync's) go to the new sync's main copies.

        .. warning:: Collective when ``make`` is: call on every rank of ``group``.
        """
        self.driver.settle()
        plan = self._new_cut() if make is None else None
        if plan is not None:
            self.adopt(plan)  # moves the state, then installs the sync
            return
        if carried is None:
            carried = self.main_values()
        self.sync.release()
        self.sync = (make or self.build)()
        self.shard.targets.point(getattr(self.sync, "piece_view", None))
        self.changes.reset(self.shard.flat_params())
        if carried:
            self.load_main(carried)

    def _targets(self) -> dict[int, torch.Tensor]:
        """The tensors this rank's inner optimizer steps, by flat index."""
        targets = self.shard.targets.targets()
        local = self.shard.plan.local_indices(self.shard.rank)
        return {i: targets[i] for indices in local for i in indices}

    def export_state(self) -> dict[int, ParamState]:
        """This rank's state by flat index, with its main copies (``OSS.export_local_state``)."""
        self.driver.wait()
        states = self.shard.export()
        for i, values in self.main_values().items():
            states.setdefault(i, {})[MAIN_KEY] = values
        return states

    def import_state(
        self,
        states: Mapping[int, ParamState],
        param_groups: list[dict[str, Any]] | None,
        extras: Extras | None = None,
    ) -> None:
        """Load ``states``, their main values into the main copies (``OSS.import_local_state``).

        Raises:
            ValueError: a main value whose size is not its param's, before anything changes.
        """
        self.driver.wait()
        plain, mains = split_main(states)
        exact = self.main_for(mains)  # checked before anything changes
        self.shard.load(plain, param_groups, extras)
        self.give_main(exact)

    def main_values(self) -> dict[int, torch.Tensor]:
        """The exact values of what this rank sent compressed, by flat index, shaped like the
        tensors its inner optimizer steps (:meth:`oss_plus.wire.main.copies.MainCopies.values`)."""
        sync = self.sync
        if not isinstance(sync, BucketSync) or not sync.mains.held:
            return {}
        return sync.mains.values(self._targets())

    def load_main(self, values: Mapping[int, torch.Tensor]) -> None:
        """Give the main copies the exact ``values`` (by flat index, of whole params or of
        this rank's pieces; those of params this rank does not hold are ignored). At world
        size 1 (nothing laid out, no replica) a value goes into its param where the param
        holds it rounded; elsewhere a value no region holds (a frozen param) is dropped.
        Not collective.

        Raises:
            ValueError: a value whose number of elements is not its param's (or piece's).
        """
        self.give_main(self.main_for(values))

    def main_for(self, values: Mapping[int, Any]) -> dict[int, torch.Tensor]:
        """Of ``values`` (see :meth:`load_main`), those of what this rank holds, cut to its
        pieces and checked (PURE: nothing changes).

        Raises:
            ValueError: a value whose number of elements is not its param's (or piece's).
        """
        shard = self.shard
        mine = {i: v for i, v in values.items() if shard.plan.piece(shard.rank, i) is not None}
        sliced = shard.targets.slice_states({i: {MAIN_KEY: v} for i, v in mine.items()})
        targets = shard.targets.targets()
        exact = {i: s[MAIN_KEY] for i, s in sliced.items()}
        for i, v in exact.items():
            if not isinstance(v, torch.Tensor) or v.numel() != targets[i].numel():
                shape = tuple(targets[i].shape)
                raise ValueError(BAD_MAIN.format(index=i, shape=shape, got=_shape_of(v)))
        # copies: the values may be views of the main copies they are about to replace (a
        # state dict this optimizer exported, e.g. the template DCP loads into in place)
        return {i: v.detach().clone() for i, v in exact.items()}

    def give_main(self, exact: Mapping[int, torch.Tensor]) -> None:
        """Give the main copies the values :meth:`main_for` returned. Not collective."""
        sync = self.sync
        if not exact or not isinstance(sync, BucketSync):
            return  # a collaborator's sync keeps its own copies
        targets = self.shard.targets.targets()
        left = sync.mains.load(targets, exact)
        if sync.world_size == 1:  # no replica to keep equal: the params take them
            for i, v in left.items():
                apply_exact(targets[i], v)

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
        :data:`~oss_plus.wire.status.REPLAN` and read every rank's code now (the one host read, on
        this rare path only). When every rank sent it, adopt ``plan`` together (agreeing on
        it) and return True (the step goes on); else every rank raises
        :data:`~oss_plus.wire.status.TRAINABILITY_DIFFERS` at the next check (the others stepped;
        this rank did not).

        .. warning:: Collective: call on every rank of ``group``, as its step's sync.
        """
        sync = self.sync
        if isinstance(sync, BucketSync) and not self.driver.replan(sync, wire):
            return False
        logger.info("trainable params changed on every rank: repartitioning")
        self.adopt(plan)
        return True
