"""The ``torch.optim`` state-dict API of :class:`oss_plus.OSS`, built on its extension contract.

:class:`ShardedStateDict` is a mixin of :class:`oss_plus.OSS`: it uses only the public
contract (:attr:`~oss_plus.OSS.plan`, :meth:`~oss_plus.OSS.export_local_state`,
:meth:`~oss_plus.OSS.import_local_state`, :meth:`~oss_plus.OSS.settle`, ``group``, ``rank``,
``world_size``), and owns the
consolidated copy of the state, which :meth:`drop_consolidated` forgets (``step()`` calls it).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from oss_plus.runtime import arrival as _arrival
from oss_plus.state import dcp as _dcp
from oss_plus.state import torch_callers
from oss_plus.state.agreement import check_agreed
from oss_plus.state.consolidate import ALL_RANKS, CPU, whole_states
from oss_plus.state.extras import Extras, attach, detach
from oss_plus.state.index import (
    ParamState,
    copy_hyper,
    own_group_keys,
    pack_param_groups,
    per_element_keys,
    saved_state_by_flat_index,
    validate_state_dict,
)
from oss_plus.state.pull import read_whole, wait_read
from oss_plus.state.serving import answer
from oss_plus.wire.main.region import MAIN_KEY

__all__ = ["CONSOLIDATE_HINT", "NOT_CONSOLIDATED", "STATE_DICT_HINT", "ShardedStateDict"]

#: What :meth:`ShardedStateDict.state_dict` raises when nothing was consolidated on this rank
#: and the class keeps fairscale's contract (``_reads_unconsolidated`` False: the fairscale
#: adapter); ``oss_plus.OSS`` reads the other ranks' shards itself instead (issue 56).
NOT_CONSOLIDATED = (
    "the optimizer state has not been consolidated on this rank: call "
    "consolidate_state_dict(recipient_rank={rank}) on every rank first, or "
    "state_dict(all_ranks=True) on every rank"
)

#: The arrival error's advice for a collective ``state_dict()``.
STATE_DICT_HINT = (
    ", or call consolidate_state_dict() on every rank first and then state_dict() on the "
    "saving rank only (see docs/integrations.md)"
)
#: The arrival error's advice for ``consolidate_state_dict()``.
CONSOLIDATE_HINT = (
    " (a framework that saves from one rank only, e.g. mmengine's CheckpointHook, needs it "
    "called on every rank before the save; see docs/integrations.md)"
)


class ShardedStateDict:
    """``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict`` for a sharded optimizer."""

    _consolidated_copy: dict[int, ParamState] | None = None
    _consolidated_extras: Extras | None = None
    _consolidated_groups: dict[tuple[int, str], Any] = {}  # noqa: RUF012 - replaced, never changed
    #: ``state_dict()`` with nothing consolidated on this rank reads the other ranks' shards
    #: (True), or raises :data:`NOT_CONSOLIDATED` (False: fairscale's contract, which its own
    #: test suite pins).
    _reads_unconsolidated: ClassVar[bool] = True
    # provided by oss_plus.OSS
    group: Any
    rank: int
    world_size: int
    param_groups: list[dict[str, Any]]
    optim: Any
    if TYPE_CHECKING:  # properties of oss_plus.OSS

        @property
        def local_shard(self) -> Any: ...
        @property
        def step_count(self) -> int: ...

    # provided by torch.optim.Optimizer (its state-dict hooks)
    _optimizer_state_dict_pre_hooks: Any
    _optimizer_state_dict_post_hooks: Any
    _optimizer_load_state_dict_pre_hooks: Any
    _optimizer_load_state_dict_post_hooks: Any

    @property
    def state(self) -> Any:
        """This rank's state by param (:class:`oss_plus.state.dcp.LocalState`: a param owned whole
        maps to its state, a param held in part to its piece's, any other to ``{}``).

        Read by torch's ``_init_optim_state`` (DCP's state-dict functions), it is collective:
        every rank agrees whether any rank holds state (see :mod:`oss_plus.state.dcp`)."""
        try:
            self.local_shard  # noqa: B018 - raises AttributeError before the shard exists
        except AttributeError:  # torch.optim.Optimizer.__init__, before the shard
            return {}
        if torch_callers.torch_options(torch_callers.PROBE) is not None:
            return _dcp.agreed_state(self)
        return _dcp.LocalState(self)

    @state.setter
    def state(self, value: Any) -> None:
        """Ignored: ``torch.optim.Optimizer.__init__`` assigns an empty dict; the state
        lives in the inner optimizer (:attr:`oss_plus.OSS.optim`)."""

    @property
    def consolidated_state(self) -> Mapping[int, ParamState] | None:
        """The state consolidated on this rank (flat index -> state, read-only), or None."""
        if self._consolidated_copy is None:
            return None
        return types.MappingProxyType(self._consolidated_copy)

    def drop_consolidated(self) -> None:
        """Forget the consolidated state on this rank (also done at every step)."""
        self._consolidated_copy = self._consolidated_extras = None

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the full optimizer state on ``recipient_rank`` (-1: on every rank).

        Tensors (also those nested in lists, tuples and dicts) move by send/recv (or
        broadcast for -1); their structure, shapes and dtypes travel as JSON, nothing is
        pickled. The pieces of a param split by the flat rule are stitched into its whole
        state (the plain ``torch.optim`` format). Other ranks keep no copy. The result is read by
        :meth:`state_dict` and dropped at the next ``step()``.

        What the inner optimizer's ``state_dict()`` holds beyond per-param state and param
        groups (extra keys, state not keyed by a param, a nested base optimizer's state:
        :mod:`oss_plus.state.extras`) is kept too, in the inner class's own format.

        Raises:
            ValueError: ``recipient_rank`` is not -1 or a rank of ``group``; or the ranks
                hold different values of a hyperparameter or of such an extra, which one
                state dict cannot represent (:data:`oss_plus.state.agreement.RANKS_DIFFER`,
                on every rank, before anything moves).

        .. warning:: Collective: call on every rank of ``group``. A call on some ranks only
            (a framework consolidating on the saving rank alone) raises RuntimeError there
            within the arrival timeout (:mod:`oss_plus.runtime.arrival`), never a hang.
        """
        if not -1 <= recipient_rank < self.world_size:
            raise ValueError(
                f"recipient_rank must be -1 (all ranks) or a rank in [0, {self.world_size}), "
                f"got {recipient_rank}"
            )
        if recipient_rank != ALL_RANKS and self.world_size > 1:  # read by the recipient alone
            self.settle()  # type: ignore[attr-defined]  # the last step's sync and status first
            if recipient_rank == self.rank:
                self._read_whole("consolidate_state_dict()", tell=True)
            else:
                self._consolidated_copy = self._consolidated_extras = None
                wait_read(self, recipient_rank)
            return
        steps = self.step_count
        with _arrival.entry(
            self.group, "consolidate_state_dict()", hint=CONSOLIDATE_HINT, steps=steps
        ):
            self.settle()  # type: ignore[attr-defined]  # the last step's sync and status first
            copy_hyper(self.param_groups, self.optim.param_groups)
            dst = ALL_RANKS if recipient_rank == -1 else recipient_rank
            self._consolidated_copy = self._consolidated_extras = None
            shard = self.local_shard
            extras = shard.extras()
            what = "consolidate_state_dict()"
            rank_0 = check_agreed(extras, self.param_groups, shard.built_groups, self.group, what)
            local = self.export_local_state()  # type: ignore[attr-defined]
            shapes = [p.shape for g in self.param_groups for p in g["params"]]
            plan = self.plan  # type: ignore[attr-defined]
            received = whole_states(local, plan, dst, shapes, self.group, out_device=CPU)
        if dst in (ALL_RANKS, self.rank):
            self._consolidated_copy, self._consolidated_extras = received, extras
            self._consolidated_groups = rank_0  # what differs as built: rank 0's, everywhere

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """Return the full state in the plain ``torch.optim`` format, every tensor on CPU.

        Keys of ``state`` are flat indices over the global param groups, so the dict loads
        into a plain torch optimizer or into OSS at any world size. The hooks registered
        with ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` run as in
        ``torch.optim.Optimizer.state_dict`` (pre hooks first, even before the
        consolidation of ``all_ranks``; a post hook may return a new dict).

        With ``collective_state_dict=True`` and nothing consolidated on this rank since the
        last step, the call is collective (as with ``all_ranks=True``): every rank of the
        group must call it. It first checks, out of band, that every rank came, and raises
        RuntimeError on the ranks that did if some did not within
        ``oss_plus.runtime.arrival.ARRIVAL_TIMEOUT`` (never a hang). A rank holding a consolidated
        state (``consolidate_state_dict()`` on every rank first) returns it without
        communicating, so a framework may then call ``state_dict()`` on one rank only.

        Args:
            all_ranks: consolidate on every rank first (collective).

        With nothing consolidated on this rank otherwise, this rank alone reads every other
        rank's shard as of its own step (their server threads answer; they make no call), so
        a framework may call ``state_dict()`` on one rank or on every rank with no recipe.

        Raises:
            RuntimeError: a peer's shard could not be read (:mod:`oss_plus.state.pull` names
                why), nothing was consolidated here and the class keeps fairscale's contract
                (``_reads_unconsolidated`` False), or (collective mode) some rank did not call.

        .. warning:: Collective: call on every rank of ``group`` when ``all_ranks`` is True,
            or ``collective_state_dict`` is True and nothing was consolidated here.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        options = torch_callers.torch_options(torch_callers.GET)
        if options is not None:  # torch's get_*state_dict (DCP): no gather unless asked
            return self._run_post_hooks(self._dcp_state_dict(options))
        what = "state_dict(all_ranks=True)"
        collective = getattr(self, "collective_state_dict", False)
        if collective and self._consolidated_copy is None and not all_ranks:
            what, all_ranks = "state_dict()", True
        if all_ranks:
            with _arrival.entry(self.group, what, hint=STATE_DICT_HINT, steps=self.step_count):
                self.consolidate_state_dict(-1)  # positional: the torch adapter names it `to`
        if self._consolidated_copy is None and (
            not self._reads_unconsolidated or torch_callers.from_checkpoint()
        ):  # fairscale's contract, or DCP's flow on a torch whose functions differ: DCP
            # would take a whole state for this rank's shard
            raise RuntimeError(NOT_CONSOLIDATED.format(rank=self.rank))
        if self._consolidated_copy is None:  # read here alone: the other ranks make no call
            self.settle()  # type: ignore[attr-defined]  # the last step's sync and status first
            self._read_whole("state_dict()")
        copy = self._consolidated_copy
        assert copy is not None  # consolidated above, or read here
        state = {i: dict(copy[i]) for i in sorted(copy)}
        groups = pack_param_groups(self.param_groups, own_group_keys(self.optim))
        for (g, key), value in self._consolidated_groups.items():
            if key in groups[g]:
                groups[g][key] = value
        state_dict = {"state": state, "param_groups": groups}
        if self._consolidated_extras is not None:  # the inner class's own format
            state_dict = attach(state_dict, self._consolidated_extras)
        return self._run_post_hooks(state_dict)

    def _read_whole(self, what: str, tell: bool = False) -> None:
        """Read every rank's shard on this rank alone and keep the whole state
        (:func:`oss_plus.state.pull.read_whole`; ``tell``: the ranks waiting in
        ``consolidate_state_dict`` raise what this read raises)."""
        received, rank_0 = read_whole(self, what, tell)  # compares the inner groups: then copy
        copy_hyper(self.param_groups, self.optim.param_groups)
        self._consolidated_copy, self._consolidated_extras = received, self.local_shard.extras()
        self._consolidated_groups = rank_0

    def _answer_read(self, request: dict[str, Any], send: Any) -> None:
        """Serve this rank's shard to another rank's read (on the server thread,
        :mod:`oss_plus.state.serve`)."""
        answer(self, request, send)

    def _dcp_state_dict(self, options: Any) -> dict[str, Any]:
        """``state_dict()`` as torch's ``get_*state_dict`` asked for it (``options``)."""
        flat = bool(getattr(options, "flatten_optimizer_state_dict", False))
        if getattr(options, "full_state_dict", False):
            cpu_offload = bool(getattr(options, "cpu_offload", False))
            return _dcp.full_state_dict(self, cpu_offload, flat)
        return _dcp.sharded_state_dict(self, template=torch_callers.for_full_load(), flat=flat)

    def _run_post_hooks(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (oss_plus, fairscale OSS, torch ZeRO or plain torch).

        Each rank keeps the state of the params it owns. ``state_dict`` is not modified and
        no tensor of it is aliased by the optimizer. Hooks registered with
        ``register_load_state_dict_pre_hook`` (which get a shallow copy and may return a new
        dict) and ``register_load_state_dict_post_hook`` run as in
        ``torch.optim.Optimizer.load_state_dict``. Not collective.

        Raises:
            ValueError: the state dict does not fit the param groups (count, sizes, shapes).
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if (
            torch_callers.torch_options(torch_callers.LOAD) is not None
        ):  # torch's set_*state_dict (DCP)
            _dcp.load_sharded(self, state_dict)
        else:
            self._load_full(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_full(self, state_dict: dict[str, Any]) -> None:
        shapes = [[p.shape for p in g["params"]] for g in self.param_groups]
        form, extras = _split_loaded(state_dict)
        validate_state_dict(form, shapes, per_element_keys(self.optim) | {MAIN_KEY})
        states = saved_state_by_flat_index(form)
        self.import_local_state(  # type: ignore[attr-defined]
            states, form["param_groups"], extras=None if extras.empty else extras
        )


def _split_loaded(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Extras]:
    """A loaded state dict as the ``torch.optim`` format and its extras
    (:func:`oss_plus.state.extras.detach`); one of neither form fails validation as before."""
    try:
        return detach(state_dict)
    except (ValueError, TypeError, AttributeError, KeyError):
        return state_dict, Extras({"state": {}}, ("state", "param_groups"))
