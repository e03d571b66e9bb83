"""The sharded optimizer: orchestration only (shard plan -> local step -> sync).

Each rank of ``group`` keeps the optimizer state of the parameters it owns and steps them
with an ordinary ``torch.optim`` optimizer (``self.optim``); after the local step every owner
broadcasts its parameters (:mod:`oss_plus.wire.sync`). Who owns what is a frozen
:class:`~oss_plus.planning.plan.ShardPlan` (pure code: :mod:`oss_plus.planning.plan`); moving
state between ranks is :mod:`oss_plus.state.consolidate`; following the params' changes
(plan again, lay out again) is :mod:`oss_plus.step.replan`.

Collaborators (checkpoints, overlap, gradient sharding, the adapters) use only the
*extension contract* (API reference); no other module touches an underscore member of
:class:`OSS` (``tests/test_plan.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

from oss_plus import hybrid
from oss_plus.amp.clip import ShardedClip
from oss_plus.amp.scaler import ScalerContract
from oss_plus.planning.partition import Rule
from oss_plus.planning.plan import ShardPlan, ShardPolicy, make_plan
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.state import copies
from oss_plus.state.api import NOT_CONSOLIDATED, ShardedStateDict
from oss_plus.state.extras import Extras
from oss_plus.state.index import ParamState, copy_hyper
from oss_plus.state.serving import Serving
from oss_plus.step import params as _params
from oss_plus.step.coupling import refuse_cross_param
from oss_plus.step.driver import StepDriver
from oss_plus.step.modes import Modes
from oss_plus.step.params import PLANS_DIFFER
from oss_plus.step.pieces import PieceGrads
from oss_plus.step.replan import Replanner
from oss_plus.step.shard import LocalShard, evaluate_first
from oss_plus.step.views import PlanViews
from oss_plus.wire.inflight import ForwardWaits
from oss_plus.wire.sync import BucketSync

__all__ = ["NOT_CONSOLIDATED", "OSS", "PLANS_DIFFER"]


class OSS(PlanViews, ScalerContract, PieceGrads, ShardedClip, ShardedStateDict, Modes, Optimizer):
    """Shards the state of any ``torch.optim`` optimizer over the ranks of a process group.

    Every rank owns about ``1/world_size`` of the parameters (whole tensors, or pieces of
    them with ``partition_rule="flat"``), keeps optimizer state for those only, steps them,
    then broadcasts them so all replicas stay identical.
    In fp32 the parameters are bit-identical to those of the unsharded optimizer.

    Args:
        params: tensors, ``named_parameters()`` pairs, or param-group dicts (a generator is fine).
        optim: the optimizer class to shard (default ``torch.optim.SGD``).
        group: the process group to shard over (default: WORLD). It may be any subgroup,
            including one without global rank 0.
        broadcast_buffer_size: ignored; kept for fairscale compatibility.
        broadcast_fp16: send parameters as fp16 on the wire (a plain attribute, read at every
            step): every replica holds the same rounded values, the owner keeps the exact
            ones in a main copy (``docs/amp.md``).
        force_broadcast_object: ignored (state never travels as a pickled object here).
        partition_rule: ``"fairscale"`` (default: given order, frozen params weigh 1),
            ``"torch"`` (largest first, frozen params weigh their size) or ``"muon"``
            (largest Newton-Schulz cost first), each keeping params whole, or ``"flat"``: the
            trainable params back to back, cut into ``world_size`` equal ranges (a param may
            be split; elementwise optimizers only, :func:`oss_plus.elementwise`). See
            ``docs/partition.md``. Overrides the rule of ``shard_policy``.
        broadcast_dtype: keyword-only wire dtype, ``torch.float16`` or ``torch.bfloat16``;
            ``broadcast_fp16=True`` takes precedence and means ``torch.float16``.
        shard_policy: keyword-only :class:`~oss_plus.planning.plan.ShardPolicy` (partition rule,
            local order, bucket layout, transport); how the adapters customise the core.
        replicate_group: keyword-only, for hybrid sharding: the ranks holding the same shard
            as this one (:func:`oss_plus.hybrid_groups` builds both). The state is sharded
            within ``group`` and replicated across this group (``docs/hybrid.md``); the
            groups must tile the world (one all_gather over WORLD: construct on every rank).
        collective_state_dict: keyword-only, a plain attribute: :meth:`state_dict` without a
            prior consolidation here is collective (frameworks calling it on every rank;
            ``docs/integrations.md``).
        auto_refresh: keyword-only, a plain attribute read at every step (default True):
            :meth:`step` follows ``requires_grad`` changes (as :meth:`refresh_trainable`) and
            re-allocated params (as :meth:`install_sync`; what is read when:
            :mod:`oss_plus.wire.changes`). With False, call those two yourself.
        allow_cross_param: keyword-only: shard an optimizer whose update of one param reads
            the others (refused by default: :mod:`oss_plus.step.coupling`, ``docs/optimizers.md``).
        **defaults: hyperparameters for ``optim`` (``lr=...``). Keys ``optim`` does not take
            but fixes to the same value are dropped (``OSS(opt.param_groups, type(opt),
            **opt.defaults)`` with AdamW); any other unknown keyword raises TypeError.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: ``params`` holds a non-tensor, ``optim`` is not an optimizer class, or a
            keyword ``optim`` does not take (raised on every rank).
        ValueError: empty or sparse params, a param listed twice, an optimizer whose update
            is not per parameter (``torch.optim.LBFGS``) or reads other params (unless
            ``allow_cross_param``), ``partition_rule="flat"`` with an optimizer not known to
            be elementwise, or different models on the ranks of ``group`` (on every rank, as
            whatever the inner optimizer's constructor raises on any rank).

    Example:
        >>> opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP

    ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` of an ``OSS`` raise
    TypeError saying how to keep its state instead (:mod:`oss_plus.state.copies`).

    .. warning:: Collective: construct on every rank of ``group``.
    """

    # copy.deepcopy, copy.copy, pickle and torch.save raise TypeError: oss_plus.state.copies
    __deepcopy__ = copies.refuse_deepcopy
    __reduce_ex__ = copies.refuse_reduce

    def __init__(
        self,
        params: Any,
        optim: type[Optimizer] | Callable[..., Optimizer] = SGD,
        group: Any | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        *,
        partition_rule: Rule | str | None = None,
        broadcast_dtype: torch.dtype | None = None,
        shard_policy: ShardPolicy | None = None,
        replicate_group: Any | None = None,
        collective_state_dict: bool = False,
        auto_refresh: bool = True,
        allow_cross_param: bool = False,
        **defaults: Any,
    ) -> None:
        self.group = _dist.resolve_group(group)
        arrival = _arrival.check_arrival(self.group, f"{type(self).__name__}()")  # some: raise
        if replicate_group is not None:  # before anything else: a mistake raises everywhere
            hybrid.check_groups(self.group, replicate_group)
        #: The ranks holding the same shard (hybrid sharding), or None.
        self.replicate_group = replicate_group
        self.collective_state_dict = collective_state_dict
        self.auto_refresh = auto_refresh
        self.allow_cross_param = allow_cross_param
        self._initialized = False
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.global_rank = _dist.global_rank(self.group, self.rank)
        self._serving = Serving()  # before the collective checks: no peer reads before
        self._serving.start(arrival, self._answer_read)  # served under the id every rank has
        self.broadcast_fp16 = broadcast_fp16
        self.broadcast_dtype = broadcast_dtype
        self.force_broadcast_object = force_broadcast_object
        self._driver = StepDriver(self.group, self.world_size)
        error: Exception | None = None
        try:  # everything a rank may reject, agreed on by every rank below
            self._policy = _params.check_options(
                optim, broadcast_dtype, shard_policy, partition_rule, auto_refresh
            )
            super().__init__(_params.normalize_params(params), defaults)
            taken, fixed = _params.split_defaults(optim, defaults)
            _params.check_named(optim, self.param_groups, taken)  # (name, param) constructors
            specs = _params.param_specs(self.param_groups, self._policy.aligned)
            plan = make_plan(specs, self.world_size, self._policy)
            self._shard = LocalShard(self.param_groups, plan, self.rank, optim, taken)
            refuse_cross_param(optim, taken, self)  # after the real construction's own errors
            _params.check_fixed_defaults(self.optim, fixed)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by check_same_model
            error = exc
        _params.check_same_model(None if error else self.param_groups, error, self.group)
        copy_hyper(self.optim.param_groups, self.param_groups)
        self._replanner = Replanner(self._shard, self._policy, self.group, self._driver)
        self._initialized = True
        self._serving.ready.set()

    @property
    def optim(self) -> Optimizer:
        """The inner ``torch.optim`` optimizer over this rank's shard (rebuilt when the shard
        changes)."""
        return self._shard.optim

    @property
    def plan(self) -> ShardPlan:
        """The current shard plan (a frozen value; a new object after every repartition)."""
        return self._shard.plan

    @property
    def step_count(self) -> int:
        """The :meth:`step` calls this rank made that ran the parameter sync (a failed local
        step included; a step a ``GradScaler`` skipped on every rank not). Every rank holds
        the same count: the collective entry points compare it and raise when it differs
        (:data:`oss_plus.runtime.arrival.STEPS_DIFFER`). Read-only, not saved in state."""
        return self._driver.steps

    @property
    def shard_reads(self) -> Serving:
        """How other ranks read this rank's shard when one rank reads the whole state alone
        (``state_dict()`` or ``consolidate_state_dict(r)`` on some ranks: issue 56): the lock
        :meth:`step` holds around its local step, and the step count the shard is at
        (:class:`oss_plus.state.pull.Serving`). Read by :mod:`oss_plus.state.pull`."""
        return self._serving

    @property
    def policy(self) -> ShardPolicy:
        """The :class:`~oss_plus.planning.plan.ShardPolicy` this optimizer was built with."""
        return self._policy

    def export_local_state(self) -> dict[int, ParamState]:
        """Return this rank's optimizer state keyed by flat index.

        The per-param dicts are new; their tensors are the live ones (not copies): copy them
        before the next :meth:`step` if they must outlive it. For a param the plan splits
        (``plan.split``), the state is this rank's piece (``plan.piece(rank, index)``):
        tensors shaped like the param hold the piece's elements, 1-D
        (:func:`oss_plus.state.pieces.stitch_state` makes the whole state of the pieces).

        Under a compressed wire, the exact values of what this rank sends (its main
        copies, ``docs/amp.md``) are the entry :data:`oss_plus.wire.main.region.MAIN_KEY`
        (``"oss_plus.main"``) of each param's state, shaped like the param (its piece).
        """
        return self._replanner.export_state()

    def import_local_state(
        self,
        states: Mapping[int, ParamState],
        param_groups: list[dict[str, Any]] | None = None,
        *,
        extras: Extras | None = None,
    ) -> None:
        """Load the states of the params this rank owns (flat index -> state).

        Entries for params owned elsewhere are ignored; tensors are copied, never aliased,
        and cast by the inner optimizer's own policy (dtype, device, CPU/device ``step``).
        The states are those of whole params: of a param the plan splits, this rank keeps
        its piece (a state whose tensors already have the shape of this rank's piece,
        1-D, as :meth:`export_local_state` gives them, is taken as it is). With
        ``param_groups`` (state-dict form), their hyperparameters are loaded first. An
        ``"oss_plus.main"`` entry (exact values, :meth:`export_local_state`) goes to the
        main copies, never to the inner optimizer. ``extras``: what the inner optimizer's
        ``state_dict()`` holds beyond per-param state and groups, for its
        ``load_state_dict`` (:mod:`oss_plus.state.extras`; ``local_shard.extras()`` gives
        them). Not collective.

        Raises:
            ValueError: an ``"oss_plus.main"`` entry whose size is not its param's.
        """
        with self._serving.lock:  # a peer's read of this shard sees it before or after
            self._serving.keep(self)  # as read, if this rank read the whole state before
            self._replanner.import_state(states, param_groups, extras)
            self._serving.loads += 1
            self._serving.changed.notify_all()
        self.drop_consolidated()

    def repartition(self, plan: ShardPlan | None = None, *, pin: bool = False) -> None:
        """Adopt ``plan`` (default: plan again by the policy) and move state to new owners.

        Every param whose owner changes (or whose pieces change, under the flat rule) has its
        optimizer state sent to the new owner(s); the inner optimizer is rebuilt over the new
        shard and the sync layout rebuilt. When no owner, piece or local order changes, the
        inner optimizer is kept as it is. With ``pin``,
        later automatic repartitions (``refresh_trainable``, ``add_param_group``) keep this
        plan's owners (the overlap with DDP assigns params by DDP bucket).

        Raises:
            ValueError: ``plan`` does not fit the param groups or the world size, or the
                ranks hold different plans (e.g. ``requires_grad`` changed on some ranks
                only); raised on every rank, before any state moves.

        .. warning:: Collective: call on every rank of ``group`` with the same plan (a call
            on some ranks only raises there, :mod:`oss_plus.runtime.arrival`).
        """
        with _arrival.entry(self.group, "repartition()", steps=self.step_count):
            self._replanner.adopt(plan, pin)  # settles the last step first
        self.drop_consolidated()

    @property
    def sync(self) -> BucketSync:
        """The object that synchronises parameters after the local step."""
        return self._replanner.sync

    sync_buckets = sync  #: alias of :attr:`sync`

    def install_sync(self, make: Callable[[], Any] | None = None) -> None:
        """Release the parameter sync (params get their own storage back), then install
        ``make()`` (default: the policy's layout) for the next steps.

        The object needs ``sync(wire_dtype, error)`` (raising on every rank when ``error``
        is given on any rank), ``is_intact()`` and ``release()``; a
        :class:`oss_plus.wire.sync.BucketSync` is launched instead, its status checked at the
        next check (:meth:`settle`). The last step is settled first; the consolidated
        state is dropped.

        Under the flat rule the cut depends on the params' dtypes and devices: when they
        changed (``module.double()``), the default rebuild repartitions first.

        .. warning:: Collective when ``make`` is: call on every rank of ``group``.
        """
        self._replanner.install(make)  # settles the last step first
        self.drop_consolidated()

    @property
    def local_shard(self) -> LocalShard:
        """This rank's :class:`~oss_plus.step.shard.LocalShard`: the plan, the tensors its inner
        optimizer steps (whole params, or the pieces of split ones) and that optimizer."""
        return self._shard

    def trainability_changed(self) -> bool:
        """Whether ``requires_grad`` changed since the plan was made, as :meth:`step` reads it
        (:mod:`oss_plus.wire.changes`: a frozen param unfrozen at once, a freeze within a few
        calls; never at world size 1 nor with ``auto_refresh`` False). Call it on every rank
        alike: each call reads the next slice of the trainable params."""
        return self.auto_refresh and self._replanner.changes.trainability_changed()

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step the local shard, then broadcast every shard to every rank.

        Args:
            closure: re-evaluates the model and returns the loss. It runs first, before
                anything it may replace is read (the sync, the inner optimizer, the pieces:
                fairscale's ``ShardedDataParallel`` calls :meth:`refresh_trainable` in its
                forward, as under Lightning 1.9's ``ddp_sharded``); the local step's first
                call of it returns that loss, later calls (an inner optimizer that calls it
                again) run it again. A value that is not callable is passed to the inner
                step as it is, as fairscale passes it.
            **kwargs: passed to the inner optimizer's ``step``.

        Returns:
            What the inner step returned (the closure's loss).

        Raises:
            Exception: what the last step reported (raised first, on every rank: see
                :meth:`settle`). A failure of this step's local step (optimizer, closure,
                inner hooks) on any rank is raised on every rank at the next check (at
                world size 1: here); the sync completes first and nothing is undone (see
                ``docs/design.md``, "When a step fails").
            RuntimeError: stepped by a plain ``torch.amp.GradScaler`` that cannot be followed
                exactly (:func:`oss_plus.amp.scaler.scaled_step_skips`), on every rank, nothing
                updated.

        .. warning:: Collective: call on every rank of ``group``.
        """
        self.settle()
        if self._scaled_step_skips():  # a GradScaler's inf/NaN, agreed by every rank (amp.py)
            return None
        replan = self._replanner
        if self.auto_refresh:  # a changed plan is adopted by every rank together, or none
            plan = replan.follow()
            if plan is not None and not replan.together(plan, self.wire_dtype):
                return None  # this rank's plan changed, not every rank's
        self.drop_consolidated()
        error = evaluate_first(closure, kwargs)  # first, then read what it may replace
        sync, redirect = replan.sync, None
        with self._serving.lock:  # a peer's read of this shard (state/pull.py) sees it whole
            self._serving.keep(self)  # as read, if this rank read the whole state at this step
            copy_hyper(self.param_groups, self.optim.param_groups)
            if isinstance(sync, BucketSync):  # the exact values of what went compressed step
                redirect = sync.restore(self.wire_dtype, stepped=self._shard.stepped)
            loss, error = self._shard.step(kwargs, redirect) if error is None else (None, error)
            self._serving.steps = self._driver.steps + 1
            self._serving.changed.notify_all()
        self._driver.send(sync, self.wire_dtype, error)
        copy_hyper(self.optim.param_groups, self.param_groups)
        return loss

    def settle(self) -> None:
        """Finish the last step: wait for its parameter sync (still in flight after
        :meth:`attach`), then raise on every rank what any rank's step reported.

        Every rank raises what a step reported at the same call: the first check after that
        step (this method, or the start of the next :meth:`step`, :meth:`clip_grad_norm`,
        :meth:`consolidate_state_dict`, :meth:`refresh_trainable`, :meth:`repartition`,
        :meth:`add_param_group`, :meth:`install_sync`, a checkpoint save or load; see
        ``docs/design.md``, "When a step fails"). Call it right after :meth:`step` to raise
        in that step's iteration (one host read of the peers' status). When nothing was
        reported: no collective, no host read.

        Raises:
            Exception: a rank's last step raised (that rank's error there, elsewhere one of
                the same type naming it).
            ValueError: ``requires_grad`` changed on some ranks only before the last step
                (:data:`oss_plus.wire.status.TRAINABILITY_DIFFERS`).

        .. warning:: Collective when a step failed: call on every rank of ``group``.
        """
        self._driver.settle()

    def attach(self, model: torch.nn.Module) -> ForwardWaits:
        """Overlap the parameter sync of every :meth:`step` with the next forward of ``model``.

        After this call :meth:`step` starts the sync and returns without waiting for it; a
        forward pre-hook on every module of ``model`` that owns params of this optimizer
        waits, when the module is called, for the transfers of the buckets holding its
        params only (Megatron-Core's ``overlap_param_gather``). Params no module of ``model``
        owns are waited for before :meth:`step` returns. :meth:`settle`, the next
        :meth:`step`, :meth:`clip_grad_norm`, the state-dict and checkpoint calls, a
        repartition and :meth:`export_local_state` / :meth:`import_local_state` wait for the
        rest first; :meth:`zero_grad` does not (it touches no param; waiting there would
        serialise the usual ``step(); zero_grad(); forward`` loop). Results are bit-identical
        to the blocking sync. Code that reads params outside the forward of ``model`` between
        a step and the next forward must call :meth:`settle` first.

        Args:
            model: the module whose forward uses the params (e.g. the DDP module).

        Returns:
            The hooks; ``remove()`` them to make steps wait again. Not collective.

        Example:
            >>> opt.attach(model)  # doctest: +SKIP
            >>> model(x).sum().backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
        """
        return self._driver.attach(model, self.flat_params())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; params already placed keep their owner (and their state).

        The new params are placed by the partition rule on top of the current totals; their
        trainability is tracked like every other param's.

        .. warning:: Collective: call on every rank of ``group`` with the same group (a call
            on some ranks only raises there, :mod:`oss_plus.runtime.arrival`).
        """
        if not self._initialized:
            super().add_param_group(param_group)
            return
        with _arrival.entry(self.group, "add_param_group()", steps=self.step_count):
            self.settle()
            super().add_param_group(_params.new_group(param_group, self.flat_params()))
            self._replanner.add_group()
        self.drop_consolidated()

    def refresh_trainable(self) -> None:
        """Repartition over the params trainable now and move state to the new owners.

        Every param whose owner changes has its optimizer state sent to the new owner, so
        no momentum or moment estimate is lost. Buckets are rebuilt. When no owner changes,
        the inner optimizer (``self.optim``) is kept as it is and nothing is exchanged.
        Also runs automatically at :meth:`step` when ``requires_grad`` changed.

        .. warning:: Collective: call on every rank of ``group`` (a call on some ranks only
            raises there within the arrival timeout, :mod:`oss_plus.runtime.arrival`).
        """
        with _arrival.entry(self.group, "refresh_trainable()", steps=self.step_count):
            self.repartition()
