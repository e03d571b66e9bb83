"""Drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``, built on :class:`oss_plus.OSS`.

Same constructor, sorted-greedy partition (largest first within each group, frozen params
weigh their size), both sync layouts (per-param broadcasts, or flat bucket views with
``parameters_as_bucket_view=True``), automatic detection of trainability changes,
``consolidate_state_dict(to)`` / ``state_dict()`` / ``load_state_dict`` in the plain
``torch.optim`` format, the exception types torch raises for bad ``params``, ``optim`` (the
local optimizer), ``_all_params``, and :class:`~torch.distributed.algorithms.join.Joinable`
support for uneven inputs. In fp32 the parameters are bit-identical to torch ZeRO's.
It is not a subclass or wrapper of torch's class. ``docs/migration.md`` lists the
differences (bug fixes). :func:`install` makes ``torch.distributed.optim.ZeroRedundancyOptimizer``
resolve to it for code imported afterwards.

Example:
    >>> from oss_plus.compat.torch import ZeroRedundancyOptimizer  # doctest: +SKIP
    >>> opt = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from oss_plus.compat._base import CompatOSS
from oss_plus.compat._torch_install import install, is_installed, provide, uninstall
from oss_plus.compat._torch_params import (  # noqa: F401 - the messages are public here too
    FUNCTIONAL_OPTIMIZER,
    GROUP_PARAMS_SET,
    GROUP_WITHOUT_PARAMS,
    NO_PARAMS,
    NOT_DENSE,
    PARAMS_EMPTY,
    PARAMS_IS_TENSOR,
    PARAMS_MIXED,
    PARAMS_NOT_ITERABLE,
    check_dense,
    check_optimizer_class,
    flatten,
    overlap_optimizer_class,
    params_as_list,
    resolve_optimizer_class,
)
from oss_plus.compat.ddp_zero_hook import (
    OverlapPlan,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from oss_plus.planning.partition import Rule
from oss_plus.planning.policy import Layout, ShardPolicy
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.step import params as _params

__all__ = [
    "ZeroRedundancyOptimizer",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "install",
    "is_installed",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: torch's messages for what ``overlap_with_ddp=True`` does not support.
OVERLAP_ONE_GROUP = (
    "ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group"
)
OVERLAP_STEP = "`step()` should not be included in the training loop when `overlap_with_ddp=True`"
OVERLAP_BUCKET_VIEW = (
    "`parameters_as_bucket_view=True` will be ignored since `overlap_with_ddp=True`; instead, "
    "a different bucketing strategy will be used"
)
#: What :meth:`ZeroRedundancyOptimizer.state_dict` raised without a prior consolidation here,
#: before it read the other ranks' shards itself (issue 56); kept for code that names it.
NOT_CONSOLIDATED = (
    "the optimizer state has not been consolidated on this rank: call "
    "consolidate_state_dict(to={rank}) on every rank first"
)


class _ZeroJoinHook(JoinHook):
    """Shadows the optimizer step on a rank that ran out of inputs (a step, as torch does).

    Unlike torch's hook, the shadow step does not notify the join context: the context
    already matched the active ranks' notification with its own all_reduce, so a second
    one (torch's hook calls ``step()``) hangs or aborts when the optimizer is the first
    joinable, or the only one.
    """

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        super().__init__()
        self.zero = zero

    def main_hook(self) -> None:
        """Step with the gradients in place, so the broadcasts of the others are matched.

        With ``overlap_with_ddp=True`` nothing (torch's hook calls ``step()``, a no-op there).
        """
        if not self.zero._overlap_with_ddp:
            self.zero._step_and_sync()


class ZeroRedundancyOptimizer(CompatOSS, Joinable):
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` on oss_plus's core.

    Args:
        params: tensors or param-group dicts (not ``named_parameters()`` pairs, as torch).
        optimizer_class: the local optimizer class (e.g. ``torch.optim.Adam``), or the name
            of a ``torch.optim`` class (``"AdamW"``), as config files write it.
        process_group: the group to shard over (default: WORLD).
        parameters_as_bucket_view: pack each rank's trainable params into one flat buffer
            and make ``param.data`` views into it (one broadcast per rank instead of one
            per param).
        overlap_with_ddp: run the step inside DDP's backward instead of in :meth:`step`:
            register ``hook_with_zero_step(allreduce_hook, ddp, opt)`` (or the interleaved
            variant) with ``ddp.register_comm_hook(None, ...)``; one param group only;
            ``parameters_as_bucket_view`` is ignored (the params are laid out by DDP
            bucket); any ``torch.optim`` class (or torch's functional equivalent) works.
            See ``docs/overlap.md``.
        collective_state_dict: keyword-only (not in torch): :meth:`state_dict` without a
            prior consolidation is collective and consolidates on every rank (Accelerate).
        allow_cross_param: keyword-only (not in torch, which shards such optimizers
            silently): see :class:`oss_plus.OSS`.
        **defaults: hyperparameters for ``optimizer_class``.

    Raises:
        TypeError: ``params`` is a tensor, not iterable, or mixes tensors and dicts.
        ValueError: an ``optimizer_class`` string that names no ``torch.optim`` optimizer,
            empty params, a group without ``params``, a non-tensor, sparse or
            other-device-type param, a functional optimizer without ``overlap_with_ddp``,
            or ranks holding different models (raised on every rank).
        RuntimeError: ``overlap_with_ddp=True`` with several param groups (torch raises it
            later, inside the first backward after its warm-up).

    Example:
        >>> opt = ZeroRedundancyOptimizer(ddp.parameters(), Adam, lr=0.01)  # doctest: +SKIP
        >>> with Join([ddp, opt]):  # doctest: +SKIP
        ...     for batch in batches:
        ...         ddp(batch).sum().backward(); opt.step()

    A plain ``torch.amp.GradScaler`` steps it as it steps torch's class (unscale, then skip
    on the rank that found inf/NaN): ``OSS``'s scaling contract (:mod:`oss_plus.amp.scaler`) is off
    here, since the shadow step of a rank that joined (``Join``) could not take part in its
    agreement. ``oss_plus.ShardedGradScaler`` agrees on the flag (outside ``Join``).

    .. warning:: Collective: construct on every rank of ``process_group``.
    """

    #: Off: torch's class has no such contract (see above).
    _step_supports_amp_scaling = False

    def handle_loss_scaling(self, enabled: bool = True) -> None:
        """Does nothing: torch's class has no such contract, and under ``Join`` it cannot
        hold (see the class doc)."""

    def __init__(
        self,
        params: Any,
        optimizer_class: type[Optimizer] | str,
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        collective_state_dict: bool = False,
        allow_cross_param: bool = False,
        **defaults: Any,
    ) -> None:
        self._overlap_with_ddp = overlap_with_ddp
        self._overlap: OverlapPlan | None = None
        self.parameters_as_bucket_view = parameters_as_bucket_view
        local_class: Any = optimizer_class
        try:
            local_class = resolve_optimizer_class(optimizer_class)
            params, flat = flatten(params_as_list(params))
            check_dense(flat)
            if overlap_with_ddp:
                local_class = overlap_optimizer_class(local_class)
                if isinstance(params[0], dict) and len(params) > 1:
                    raise RuntimeError(OVERLAP_ONE_GROUP)
            else:
                check_optimizer_class(local_class)
        except (TypeError, ValueError, RuntimeError) as error:
            self._raise_on_every_rank(error, process_group)
        if overlap_with_ddp and parameters_as_bucket_view:
            logger.warning(OVERLAP_BUCKET_VIEW)
        layout = Layout.PER_PARAM
        if parameters_as_bucket_view and not overlap_with_ddp:
            layout = Layout.ORDERED_BUCKETS
        policy = ShardPolicy(rule=Rule.TORCH, layout=layout, aligned=False, single_rank_layout=True)
        super().__init__(
            params,
            local_class,
            process_group,
            shard_policy=policy,
            collective_state_dict=collective_state_dict,
            allow_cross_param=allow_cross_param,
            **defaults,
        )
        Joinable.__init__(self)
        self._zero_ready = True

    def _raise_on_every_rank(self, error: Exception, process_group: Any) -> NoReturn:
        """Raise ``error`` here and an error on the ranks whose params were fine.

        Takes part in the arrival check and the collective the core's constructor makes on
        the other ranks.
        """
        group = _dist.resolve_group(process_group)
        _arrival.check_arrival(group, f"{type(self).__name__}()")
        _params.check_same_model(None, error, group)
        raise error  # check_same_model raised it already; for type checkers

    # ----------------------------------------------------------------- torch attributes
    @property
    def process_group(self) -> Any:
        """The process group the state is sharded over."""
        return self.group

    @property
    def initialized(self) -> bool:
        return getattr(self, "_zero_ready", False)

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every param of every group, in order (including groups added later)."""
        return self.flat_params()

    @property
    def _default_device(self) -> torch.device:
        return self.flat_params()[0].device

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        return self.param_to_rank

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(self.flat_params())}

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        return self.flat_params()

    @property
    def _all_state_dicts(self) -> list[dict[str, Any]]:
        """After consolidation on this rank: every rank's local state dict, rank by rank."""
        return self._rank_state_dicts()

    def _partition_parameters(
        self, params_per_rank: list[list[torch.Tensor]] | None = None
    ) -> list[list[dict[str, Any]]]:
        """Return, for every rank, its param groups (torch's private helper, read by tests).

        Raises:
            NotImplementedError: ``params_per_rank`` (a manual partition, used by
                ``overlap_with_ddp`` only).
        """
        if params_per_rank is not None:
            raise NotImplementedError("a manual partition (params_per_rank) is not supported")
        return self.partition_parameters()

    # ----------------------------------------------------------------- Joinable
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the hook that shadows :meth:`step` on ranks that ran out of inputs.

        Args:
            kwargs: ignored (torch's hook takes none either).
        """
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.group

    # ----------------------------------------------------------------- stepping and state
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step the local shard and broadcast every shard (see :meth:`oss_plus.OSS.step`).

        Inside ``Join`` it first tells the join context that this rank still has inputs.

        .. warning:: Collective: call on every rank of ``process_group``.
        """
        if self._overlap_with_ddp:
            logger.warning(OVERLAP_STEP)
            return None
        Join.notify_join_context(self)
        return self._step_and_sync(closure, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; params already placed keep their owner and state.

        Raises:
            RuntimeError: ``overlap_with_ddp=True`` (one param group only, as torch).

        .. warning:: Collective: call on every rank of ``process_group`` with the same group.
        """
        if self.initialized and self._overlap_with_ddp:
            raise RuntimeError(OVERLAP_ONE_GROUP)
        super().add_param_group(param_group)

    # ----------------------------------------------------------------- overlap_with_ddp
    def _step_and_sync(
        self, closure: Callable[[], float] | None = None, **kwargs: Any
    ) -> float | None:
        """The step without the join notification (what the join hook shadows with)."""
        return super().step(closure, **kwargs)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank ``to`` of ``process_group``.

        Tensors travel by send/recv, metadata as JSON (nothing is pickled). -1: every rank.

        Raises:
            ValueError: ``to`` is not -1 or a rank of the group.

        .. warning:: Collective: call on every rank of ``process_group``.
        """
        super().consolidate_state_dict(recipient_rank=to)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Return the whole state in the plain ``torch.optim`` format (tensors on CPU).

        Where torch's class raises unless :meth:`consolidate_state_dict` ran on every rank
        first, this one reads the other ranks' shards itself when nothing was consolidated
        here (on this rank alone, or on every rank: :meth:`oss_plus.OSS.state_dict`); with
        ``collective_state_dict=True`` it consolidates on every rank (collective then).

        Raises:
            RuntimeError: a peer's shard could not be read (see :mod:`oss_plus.state.pull`),
                or some rank did not call a collective ``state_dict()``.
        """
        return super().state_dict()


# --- isinstance(opt, torch.distributed.optim.ZeroRedundancyOptimizer) (issue 15) -----------
# torch's class inherits ABCMeta from Joinable(ABC), so registering a virtual subclass is the
# standard mechanism: isinstance/issubclass against torch's class answer True (Ignite's
# Checkpoint, Lightning's checks), while the MRO, super() and every method stay oss_plus's.
# Code that then reads torch's private attributes gets oss_plus's versions where this module
# provides them (_all_params, _param_to_rank, _all_state_dicts, ...) and AttributeError for
# the rest (e.g. _overlap_info, read by torch's own ddp_zero_hook: use this module's hooks).
def _register_as_torch_zero() -> bool:
    """Register the adapter as a virtual subclass of torch's class; False if not possible."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    register = getattr(TorchZeRO, "register", None)  # present when the metaclass is ABCMeta
    if register is None:
        return False
    register(ZeroRedundancyOptimizer)
    return True


_register_as_torch_zero()
provide(ZeroRedundancyOptimizer)  # what install() puts in torch's place
