"""This rank's part of a sharded optimizer: the tensors it steps and the inner optimizer.

A :class:`LocalShard` holds the shard plan, the tensors this rank's inner ``torch.optim``
optimizer steps (every param it owns whole, and a 1-D piece tensor for every param the plan
splits: :class:`oss_plus.step.pieces.PieceTargets`) and that inner optimizer, whose groups are the
global groups restricted to them. It is how state enters and leaves the shard, by flat index
(:meth:`LocalShard.export`, :meth:`LocalShard.load`), and how the state moves when the plan
changes (:meth:`LocalShard.adopt`). :class:`oss_plus.OSS` owns one; it communicates only in
:meth:`LocalShard.adopt` (through :func:`oss_plus.state.consolidate.whole_states`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from oss_plus.planning.plan import ShardPlan, make_plan
from oss_plus.planning.policy import ShardPolicy
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label
from oss_plus.state.agreement import digest_of
from oss_plus.state.consolidate import whole_states
from oss_plus.state.extras import PREFIX, Extras, attach, detach
from oss_plus.state.index import (
    NOT_HYPER,
    ParamState,
    copy_hyper,
    local_groups,
    local_state_dict,
    place_states,
)
from oss_plus.step import params as _params
from oss_plus.step.modes import carry_mode
from oss_plus.step.pieces import PieceTargets
from oss_plus.wire.main.region import MAIN_KEY, split_main
from oss_plus.wire.main.step import Redirect

__all__ = ["LocalShard", "evaluate_first"]


class LocalShard:
    """The plan, the stepped tensors and the inner optimizer of one rank.

    Args:
        param_groups: the optimizer's global param groups (shared, not copied).
        plan: the shard plan.
        rank: this rank.
        constructor: builds the inner optimizer from local groups and ``defaults``.
        defaults: keyword arguments of ``constructor``.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        plan: ShardPlan,
        rank: int,
        constructor: Callable[..., Optimizer],
        defaults: dict[str, Any],
    ) -> None:
        self.param_groups = param_groups
        self.plan = plan
        self.rank = rank
        self._note_next = True  # the next step's new group keys are as built (_build)
        self._constructor = constructor
        self._defaults = defaults
        self.targets = PieceTargets(self.flat_params(), plan, rank)
        self.optim = self._build({})
        #: Whether the inner optimizer stepped or was given state since its construction
        #: (state it made in its constructor, SPAM's masks, is not a trained state: torch's
        #: DCP then steps it at lr 0 to complete the template, :mod:`oss_plus.state.dcp`).
        self.touched = False

    def make_plan(self, policy: ShardPolicy, keep: bool, pinned: bool) -> ShardPlan:
        """Plan again by ``policy`` (PURE planning on the params now); with ``keep`` params
        already placed keep their owners; a ``pinned`` plan is kept while the groups do not
        change."""
        specs = _params.param_specs(self.param_groups, policy.aligned)
        if pinned and self.plan.group_sizes == tuple(len(g) for g in specs):
            return self.plan
        world = self.plan.world_size
        return make_plan(specs, world, policy, keep=self.plan if keep else None)

    def step(
        self, kwargs: dict[str, Any], redirect: Redirect | None = None
    ) -> tuple[Any, Exception | None]:
        """The local step: the inner optimizer over this rank's tensors (a split param's
        piece gets its gradient first; inside ``redirect``: those pointed at their main
        copies, :mod:`oss_plus.wire.main.step`). Returns its result and what it raised
        (captured: the sync still runs, :func:`oss_plus.runtime.dist.capture`)."""
        targets, first = self.targets, self._note_next
        self.touched, self._note_next = True, False
        before = [set(g) for g in self.optim.param_groups] if first else []
        if targets.tensors:
            targets.set_grads()
        with label("oss_plus::local_step"), redirect or contextlib.nullcontext():
            loss, error = _dist.capture(lambda: self.optim.step(**kwargs))
        if first:  # what a first step adds to the groups (heavyball's param_count) is as built,
            # after a build or a load (which may have dropped it: a dict without it)
            for built, group, had in zip(self.built_groups, self.optim.param_groups, before):
                for key in group.keys() - had - set(NOT_HYPER):
                    built[key] = copy.deepcopy(group[key])
        if targets.tensors:
            targets.clear_grads()
            targets.given.clear()  # consumed
        return loss, error

    def stepped(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps (a new list)."""
        return [t for g in self.optim.param_groups for t in g["params"]]

    def flat_params(self) -> list[torch.Tensor]:
        """Every param of every global group, in flat-index order (a new list)."""
        return [p for g in self.param_groups for p in g["params"]]

    def local_groups(self, rank: int | None = None) -> list[dict[str, Any]]:
        """A rank's param groups: every global group, restricted to the params it owns (on
        this rank, a split param is represented by this rank's piece of it)."""
        mine = rank is None or rank == self.rank
        indices = self.plan.local_indices(self.rank if rank is None else rank)
        params = self.targets.targets() if mine else self.flat_params()
        return local_groups(self.param_groups, indices, params)

    def _build(self, states: dict[int, ParamState], extras: Extras | None = None) -> Optimizer:
        """Create the inner optimizer over this rank's shard and give it ``states`` (and
        ``extras``, through its own ``load_state_dict``)."""
        inner = _params.build_inner(self._constructor, self.local_groups(), self._defaults)
        #: The inner optimizer's hyperparameters as it built them (per group; with those its
        #: first step added): a value that differs between ranks but is still as built is
        #: derived from the shard, not trained (:func:`oss_plus.state.agreement.differing`).
        self.built_groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k not in NOT_HYPER}
            for g in inner.param_groups
        ]
        self._note_next = True  # the next step's new group keys are as built too
        built = self._split(inner)[0]
        #: A digest of the inner optimizer's extras as it built them (construction-time
        #: configuration, heavyball's, need not travel where they cannot: DCP's flat form).
        self.built_extras = None if built.empty else digest_of(built.to_value())
        if extras is None:
            place_states(inner, self.targets.targets(), states)
        else:
            local = self.plan.local_indices(self.rank)
            form = local_state_dict(self.param_groups, local, states, copy_tensors=False)
            inner.load_state_dict(attach(form, extras))
        return inner

    def _split(self, inner: Optimizer | None = None) -> tuple[Extras, dict[int, ParamState]]:
        """The extras of the inner optimizer (or of ``inner``, built for this plan:
        :mod:`oss_plus.state.extras`) and the entries of its nested parts, by flat index
        (live tensors). Its own ``state_dict()`` is read only when its class overrides it."""
        inner = self.optim if inner is None else inner
        if type(inner).state_dict is Optimizer.state_dict:
            keyed = {k: v for k, v in inner.state.items() if not isinstance(k, torch.Tensor)}
            return Extras({"state": keyed}, ("state", "param_groups")), {}
        form, extras = detach(inner.state_dict())
        flat = [i for indices in self.plan.local_indices(self.rank) for i in indices]
        ids = [i for g in form["param_groups"] for i in g["params"]]
        to_flat = dict(zip(ids, flat))
        nested = {to_flat[i]: s for i, s in form["state"].items()}
        if extras.top:  # the param's own entries come from the inner optimizer's state
            nested = {i: {k: s[k] for k in s if _nested_key(k)} for i, s in nested.items()}
        return extras, {i: s for i, s in nested.items() if s}

    def extras(self) -> Extras | None:
        """What the inner optimizer's ``state_dict()`` holds beyond per-param state and
        param groups (None: nothing, the plain ``torch.optim`` format)."""
        extras = self._split()[0]
        return None if extras.empty else extras

    def export(self) -> dict[int, ParamState]:
        """This rank's state by flat index (new dicts, live tensors; see
        :meth:`oss_plus.OSS.export_local_state`), the entries of nested parts
        (:data:`oss_plus.state.extras.PREFIX`) included."""
        extras, nested = self._split()
        states: dict[int, ParamState] = {}
        if extras.top:
            index = {id(p): i for i, p in enumerate(self.targets.targets())}
            for p, s in self.optim.state.items():
                if s and isinstance(p, torch.Tensor) and id(p) in index:
                    states[index[id(p)]] = dict(s)
        for i, entries in nested.items():
            states.setdefault(i, {}).update(entries)
        return states

    def load(
        self,
        states: Mapping[int, ParamState],
        param_groups: list[dict[str, Any]] | None,
        extras: Extras | None = None,
    ) -> None:
        """Load the states of what this rank holds (see
        :meth:`oss_plus.OSS.import_local_state`); ``extras`` go to the inner optimizer's
        ``load_state_dict`` with them (None: none, or the inner optimizer's own structure
        where its format nests state)."""
        self.touched = self._note_next = True
        if param_groups is not None:
            copy_hyper(copy.deepcopy(param_groups), self.param_groups, exclude=("params",))
        mine = {i: s for i, s in states.items() if self.plan.piece(self.rank, i) is not None}
        local_sd = local_state_dict(
            self.param_groups,
            self.plan.local_indices(self.rank),
            self.targets.slice_states(mine),
            copy_tensors=True,
        )
        if extras is None:
            current = self._split()[0]
            extras = None if current.top and not current.parts else current
        self.optim.load_state_dict(local_sd if extras is None else attach(local_sd, extras))
        copy_hyper(self.optim.param_groups, self.param_groups)

    def adopt(
        self, plan: ShardPlan, group: Any, mains: Mapping[int, torch.Tensor] | None = None
    ) -> dict[int, torch.Tensor]:
        """Take ``plan`` (agreed by every rank): send the state of every param whose owner
        or pieces change to its new holders, rebuild the inner optimizer over the new shard
        (kept as it is when no owner, piece or local order changes).

        ``mains`` (by flat index, this rank's exact values of what it sent compressed,
        :mod:`oss_plus.wire.main.region`) travel with the state as :data:`MAIN_KEY` entries.

        Returns:
            The exact values this rank holds under ``plan`` (of its pieces for split
            params), by flat index; the inner optimizer never sees them.

        .. warning:: Collective: call on every rank of ``group`` with the same plan.
        """
        copy_hyper(self.param_groups, self.optim.param_groups)
        old = self.plan
        changed = old.changed(plan)
        if not changed and old.local == plan.local:
            self.plan = plan
            return dict(mains or {})
        local, extras = self.export(), self.extras()  # read under the plan they were held by
        self.plan = plan
        for i, values in (mains or {}).items():
            local[i] = {**local.get(i, {}), MAIN_KEY: values}
        shapes = [p.shape for p in self.flat_params()]
        arrived = whole_states(local, old, plan.holders(changed), shapes, group)
        mine = set(plan.owned(self.rank)).difference(changed)
        kept = {i: s for i, s in local.items() if i in mine}
        self.targets = PieceTargets(self.flat_params(), plan, self.rank)
        states, moved = split_main({**kept, **self.targets.slice_states(arrived)})
        self.optim, old_inner = self._build(states, extras), self.optim
        carry_mode(old_inner, self.optim)
        copy_hyper(self.optim.param_groups, self.param_groups)
        return moved

    def add_group(self, plan: ShardPlan) -> None:
        """Take ``plan``, which places the params of a new last group and keeps every other
        owner (whole-tensor rules): the inner optimizer gains this rank's part of it."""
        self.plan = plan
        self.targets = PieceTargets(self.flat_params(), plan, self.rank)  # none split
        self.optim.add_param_group(self.local_groups()[-1])
        copy_hyper(self.optim.param_groups, self.param_groups)


def _nested_key(key: Any) -> bool:
    """Whether ``key`` holds a nested part's entries (:data:`oss_plus.state.extras.PREFIX`)."""
    return isinstance(key, str) and key.startswith(PREFIX)


def evaluate_first(closure: Any, kwargs: dict[str, Any]) -> Exception | None:
    """Run a step's ``closure`` now, gradients enabled as ``torch.optim`` does, its error
    captured and returned (:func:`oss_plus.runtime.dist.capture`: the sync still runs); put
    in ``kwargs["closure"]`` the closure to give the local step: its first call returns that
    loss, later calls run ``closure`` again (an inner optimizer that evaluates it more than
    once). A ``closure`` that is not callable goes to the inner step as it is (as fairscale
    passes it); None adds nothing.

    Why first: a closure may re-plan the optimizer it is passed to. fairscale's
    ``ShardedDataParallel`` calls ``refresh_trainable()`` in its forward (at the first one,
    and when ``requires_grad`` changed), which installs a new sync and, when owners change,
    a new inner optimizer and pieces; a step that read them before its closure would step
    and broadcast the replaced ones (issue 36: Lightning 1.9's ``ddp_sharded`` steps inside
    its closure).
    """
    if not callable(closure):
        if closure is not None:
            kwargs["closure"] = closure
        return None
    with torch.enable_grad():
        loss, error = _dist.capture(closure)
    pending = [loss]

    def replay() -> Any:
        return pending.pop() if pending else closure()

    kwargs["closure"] = replay
    return error
