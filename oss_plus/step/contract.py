"""The extension contract of :class:`oss_plus.OSS`: how its collaborators reach the shard.

:class:`ShardContract`, a mixin of ``OSS``, is the small public surface that checkpoints,
the overlap with DDP, ZeRO-2 and the adapters use instead of ``OSS``'s internals (see
``docs/design.md``, "The extension contract"): this rank's state in and out by flat index,
adopting a plan, installing a parameter sync, and what changed since the plan was made.
Each call delegates to the :class:`~oss_plus.step.replan.Replanner` that ``OSS`` owns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from oss_plus.planning.plan import ShardPlan
from oss_plus.runtime import arrival as _arrival
from oss_plus.state.index import ParamState
from oss_plus.step.replan import Replanner
from oss_plus.step.shard import LocalShard
from oss_plus.wire.sync import BucketSync

__all__ = ["ShardContract"]


class ShardContract:
    """The extension contract (module doc); a mixin of :class:`oss_plus.OSS`."""

    # provided by oss_plus.OSS
    group: Any
    auto_refresh: bool
    _replanner: Replanner
    _shard: LocalShard
    drop_consolidated: Callable[[], None]  # provided by oss_plus.state.api.ShardedStateDict

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
        self, states: Mapping[int, ParamState], param_groups: list[dict[str, Any]] | None = None
    ) -> None:
        """Load the states of the params this rank owns (flat index -> state).

        Entries for params owned elsewhere are ignored; tensors are copied, never aliased,
        and cast by the inner optimizer's own policy (dtype, device, CPU/device ``step``).
        The states are those of whole params: of a param the plan splits, this rank keeps
        its piece (a state whose tensors already have the shape of this rank's piece,
        1-D, as :meth:`export_local_state` gives them, is taken as it is). With
        ``param_groups`` (state-dict form), their hyperparameters are loaded first. An
        ``"oss_plus.main"`` entry (exact values, :meth:`export_local_state`) goes to the
        main copies, never to the inner optimizer. Not collective.

        Raises:
            ValueError: an ``"oss_plus.main"`` entry whose size is not its param's.
        """
        self._replanner.import_state(states, param_groups)
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
        with _arrival.entry(self.group, "repartition()"):
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
