"""mmengine (0.10): sharded optimizer state through a config file.

Importing this module (``custom_imports=dict(imports=["oss_plus.integrations.mmengine"])``
in a config) registers:

* ``OssZeroRedundancyOptimizer`` in mmengine's ``OPTIMIZERS``: the drop-in for torch's
  ``ZeroRedundancyOptimizer`` (:class:`oss_plus.compat.torch.ZeroRedundancyOptimizer`) with
  the local optimizer named by a string, ``optimizer_type="AdamW"`` as mmengine's own
  ``ZeroRedundancyOptimizer`` takes it (or ``optimizer_class``);
* ``OssConsolidateHook`` in mmengine's ``HOOKS``: mmengine saves from rank 0 only
  (``Runner.save_checkpoint`` is ``master_only``), and gathering the sharded state is
  collective, so this hook consolidates on every rank at each event where a
  ``CheckpointHook`` is about to save: after a training iteration or epoch at which it
  saves (asked with the checkpoint hook's own tests), and after a validation epoch when it
  keeps the best checkpoint. Its priority (``LOW``) runs it before ``CheckpointHook``
  (``VERY_LOW``) on the same event; :meth:`OssConsolidateHook.before_train` checks that order.

Neither is needed any more (issue 56): ``state_dict()`` on rank 0 alone reads the other
ranks' shards itself (:mod:`oss_plus.state.pull`), so mmengine's default ``CheckpointHook``
saves an ``OssZeroRedundancyOptimizer`` as it is, and mmengine's own
``ZeroRedundancyOptimizer`` (whose ``state_dict`` consolidates on rank 0 alone) works after
:func:`oss_plus.compat.torch.install`. The hook stays as the explicit form: it consolidates on
every rank, and no rank steps on before its shard is read.

Resuming needs nothing: ``Runner.resume`` loads the full state on every rank, and
``load_state_dict`` keeps each rank's shard. ``docs/integrations.md`` has both forms.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import HOOKS, OPTIMIZERS

from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.optimizer import OSS

__all__ = [
    "HOOK_AFTER_CHECKPOINT",
    "NOT_CONSOLIDATED_MMENGINE",
    "OssConsolidateHook",
    "OssZeroRedundancyOptimizer",
    "TWO_CLASS_NAMES",
]

logger = logging.getLogger(__name__)

#: What :meth:`OssZeroRedundancyOptimizer.state_dict` raised when nothing was consolidated
#: first, before ``state_dict()`` read the other ranks' shards itself (issue 56); kept for
#: code that names it.
NOT_CONSOLIDATED_MMENGINE = (
    "OssZeroRedundancyOptimizer.state_dict() on rank {rank} without a consolidation: mmengine "
    "saves from rank 0 only, and gathering the sharded state needs every rank. Add "
    "custom_hooks=[dict(type='OssConsolidateHook')] to the config (it consolidates on every "
    "rank before CheckpointHook saves)"
)
#: Raised by :meth:`OssConsolidateHook.before_train` when a CheckpointHook would run first.
HOOK_AFTER_CHECKPOINT = (
    "OssConsolidateHook runs after CheckpointHook (priorities {ours} and {theirs}): the "
    "checkpoint would be saved before the state is consolidated. Give OssConsolidateHook a "
    "higher priority (a lower number) than the CheckpointHook, e.g. "
    "dict(type='OssConsolidateHook', priority='LOW') with CheckpointHook's default 'VERY_LOW'"
)
#: Raised when both ``optimizer_type`` and ``optimizer_class`` are given.
TWO_CLASS_NAMES = (
    "OssZeroRedundancyOptimizer takes the local optimizer once: optimizer_type={given!r} "
    "(mmengine's name) or optimizer_class={other!r}, not both"
)


@OPTIMIZERS.register_module()
class OssZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """:class:`oss_plus.compat.torch.ZeroRedundancyOptimizer` for mmengine configs.

    Args:
        params: given by mmengine's optimizer-wrapper constructor.
        optimizer_type: the ``torch.optim`` class name (``"AdamW"``), as mmengine's own
            ``ZeroRedundancyOptimizer`` takes it; or a class.
        optimizer_class: the same under the adapter's own name (give one of the two).
        **kwargs: the adapter's other arguments and the optimizer's hyperparameters.

    Raises:
        ValueError: no optimizer named, both names given, or an unknown name (listing the
            accepted ones); raised on every rank.

    Example:
        >>> optim_wrapper = dict(  # doctest: +SKIP
        ...     optimizer=dict(type="OssZeroRedundancyOptimizer", optimizer_type="AdamW", lr=1e-3))

    .. warning:: Collective: construct on every rank of ``process_group``.
    """

    def __init__(
        self,
        params: Any,
        optimizer_type: Any = None,
        optimizer_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if optimizer_type is not None and optimizer_class is not None:
            given = ValueError(TWO_CLASS_NAMES.format(given=optimizer_type, other=optimizer_class))
            self._raise_on_every_rank(given, kwargs.get("process_group"))
        chosen = optimizer_class if optimizer_type is None else optimizer_type
        super().__init__(params, "" if chosen is None else chosen, **kwargs)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The whole state (see the adapter): on rank 0 alone, where mmengine saves, it reads
        the other ranks' shards itself (issue 56); ``OssConsolidateHook`` is not needed."""
        return super().state_dict()


@HOOKS.register_module()
class OssConsolidateHook(Hook):
    """Consolidates every oss_plus optimizer of the runner on every rank right before a
    ``CheckpointHook`` saves (see the module doc).

    Args:
        recipient: the rank of each optimizer's group that receives the state; None: the
            group's rank of global rank 0 (mmengine's saving process), or every rank (-1)
            when global rank 0 is not in the group.

    Example:
        >>> custom_hooks = [dict(type="OssConsolidateHook")]  # doctest: +SKIP
    """

    priority = "LOW"

    def __init__(self, recipient: int | None = None) -> None:
        self.recipient = recipient

    def before_train(self, runner: Any) -> None:
        """Check that this hook runs before every ``CheckpointHook``.

        Raises:
            RuntimeError: :data:`HOOK_AFTER_CHECKPOINT` (on every rank: the hooks are the
                same everywhere).
        """
        order = list(runner.hooks)
        ours = order.index(self)
        for index, hook in enumerate(order):
            if isinstance(hook, CheckpointHook) and index < ours:
                raise RuntimeError(
                    HOOK_AFTER_CHECKPOINT.format(ours=self.priority, theirs=hook.priority)
                )

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        """Consolidate if a ``CheckpointHook`` saves after this iteration.

        .. warning:: Collective: mmengine calls it on every rank.
        """
        if any(_saves_after_iter(hook, runner) for hook in _checkpoint_hooks(runner)):
            self._consolidate(runner)

    def after_train_epoch(self, runner: Any) -> None:
        """Consolidate if a ``CheckpointHook`` saves after this epoch.

        .. warning:: Collective: mmengine calls it on every rank.
        """
        if any(_saves_after_epoch(hook, runner) for hook in _checkpoint_hooks(runner)):
            self._consolidate(runner)

    def after_val_epoch(self, runner: Any, metrics: dict[str, Any] | None = None) -> None:
        """Consolidate if a ``CheckpointHook`` may keep this epoch as the best checkpoint.

        .. warning:: Collective: mmengine calls it on every rank.
        """
        hooks = _checkpoint_hooks(runner)
        if metrics and any(getattr(hook, "save_best", None) for hook in hooks):
            self._consolidate(runner)

    def _consolidate(self, runner: Any) -> None:
        for optimizer in _sharded_optimizers(runner.optim_wrapper):
            optimizer.consolidate_state_dict(self._recipient(optimizer))

    def _recipient(self, optimizer: OSS) -> int:
        if self.recipient is not None:
            return self.recipient
        ranks = dist.get_process_group_ranks(optimizer.group)
        return ranks.index(0) if 0 in ranks else -1


def _checkpoint_hooks(runner: Any) -> list[Any]:
    return [hook for hook in runner.hooks if isinstance(hook, CheckpointHook)]


def _saves_after_iter(hook: Any, runner: Any) -> bool:
    """``CheckpointHook.after_train_iter``'s own test."""
    if hook.by_epoch:
        return False
    every = hook.every_n_train_iters(runner, hook.interval, hook.save_begin)
    return bool(every or (hook.save_last and hook.is_last_train_iter(runner)))


def _saves_after_epoch(hook: Any, runner: Any) -> bool:
    """``CheckpointHook.after_train_epoch``'s own test."""
    if not hook.by_epoch:
        return False
    every = hook.every_n_epochs(runner, hook.interval, hook.save_begin)
    return bool(every or (hook.save_last and hook.is_last_train_epoch(runner)))


def _sharded_optimizers(optim_wrapper: Any) -> list[OSS]:
    """The oss_plus optimizers of an ``OptimWrapper`` or ``OptimWrapperDict``."""
    wrappers = getattr(optim_wrapper, "optim_wrappers", None)
    found = list(wrappers.values()) if wrappers is not None else [optim_wrapper]
    return [w.optimizer for w in found if isinstance(getattr(w, "optimizer", None), OSS)]
