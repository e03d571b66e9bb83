"""Drop-in for ``fairscale.optim.OSS`` (fairscale 0.4.13), built on :class:`oss_plus.OSS`.

Same constructor, partition (given order, frozen params weigh 1), bucket layout (one flat
buffer per device and owner, trainable params back to back in ascending size), state-dict
format, ``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict``,
``clip_grad_norm`` (reduced over WORLD), ``refresh_trainable``, ``add_param_group``,
``partition_parameters`` and the attributes integrations read (``optim``, ``buckets``,
``_per_device_params``, ``_param_to_rank``, ``_all_states``, ...). In fp32 the parameters are
bit-identical to fairscale's. Differences are bug fixes only; ``docs/migration.md`` lists them.

fairscale does not need to be installed: nothing here imports it. :func:`install` makes
``from fairscale.optim import OSS`` resolve to this class, with or without fairscale.

Example:
    >>> from oss_plus.compat.fairscale import OSS  # doctest: +SKIP
    >>> opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

from oss_plus.compat._base import CompatOSS
from oss_plus.compat._install import install, is_installed, provide, uninstall
from oss_plus.planning.partition import Rule
from oss_plus.planning.policy import Layout, LocalOrder, ShardPolicy
from oss_plus.runtime import dist as _dist
from oss_plus.wire.sync import Bucket

__all__ = ["OSS", "install", "is_installed", "uninstall"]

logger = logging.getLogger(__name__)

#: Raised when ``_all_states`` is assigned anything but an empty list.
ALL_STATES_READ_ONLY = (
    "OSS._all_states is derived from the consolidated state; only `opt._all_states = []` "
    "(drop the consolidated copy) can be assigned, got a {kind}"
)


#: fairscale's partition (given order, frozen params weigh 1), local order (as given) and
#: layout (params back to back: unaligned views make CPU matmul kernels round differently
#: from standalone tensors, and packing like fairscale is what makes results bit-identical).
FAIRSCALE_POLICY = ShardPolicy(
    rule=Rule.FAIRSCALE,
    local_order=LocalOrder.RULE,
    layout=Layout.OWNER_BUCKETS,
    aligned=False,
    single_rank_layout=True,
)


class OSS(CompatOSS):
    """``fairscale.optim.OSS`` with fairscale's API, partition, layout and checkpoint format.

    Args:
        params: tensors, ``named_parameters()`` pairs, or param-group dicts.
        optim: the optimizer class to shard (default ``torch.optim.SGD``).
        group: the process group to shard over (default: WORLD).
        broadcast_buffer_size: ignored (deprecated in fairscale too).
        broadcast_fp16: send params as fp16 on the wire. A plain attribute read at every
            step. Unlike fairscale, the owner keeps its exact values in a main copy, so
            small updates are not lost (fairscale #1); every replica holds them rounded.
        force_broadcast_object: ignored (state never travels as a pickled object).
        collective_state_dict: keyword-only (not in fairscale): ``state_dict()`` without a
            prior consolidation is collective and consolidates on every rank (Accelerate,
            Ignite); see :meth:`oss_plus.OSS.state_dict`.
        allow_cross_param: keyword-only (not in fairscale, which shards such optimizers
            silently): see :class:`oss_plus.OSS`.
        **default: hyperparameters for ``optim`` (``lr=...``).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: a non-tensor param, or ``optim`` is not an optimizer class.
        ValueError: empty or sparse params, a param listed twice, or ranks holding different
            models (raised on every rank, where fairscale would abort or hang).

    Example:
        >>> opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)  # doctest: +SKIP
        >>> loss.backward(); opt.step()  # doctest: +SKIP
        >>> opt.consolidate_state_dict(recipient_rank=0)  # doctest: +SKIP
        >>> if opt.rank == 0: torch.save(opt.state_dict(), "optim.pt")  # doctest: +SKIP

    .. note:: As fairscale's, ``state_dict()`` raises unless ``consolidate_state_dict()``
        ran first (on every rank, or on the recipient alone, which reads the other ranks'
        shards here instead of hanging) or ``collective_state_dict=True``: fairscale's
        contract, which its own test suite pins. :class:`oss_plus.OSS` and the torch adapter
        read the other ranks' shards themselves (``docs/integrations.md``).

    .. warning:: Collective: construct on every rank of ``group``.
    """

    _reads_unconsolidated = False

    def __init__(
        self,
        params: Any,
        optim: type[Optimizer] = SGD,
        group: Any | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        *,
        collective_state_dict: bool = False,
        allow_cross_param: bool = False,
        **default: Any,
    ) -> None:
        super().__init__(
            params,
            optim,
            group,
            broadcast_buffer_size,
            broadcast_fp16,
            force_broadcast_object,
            shard_policy=FAIRSCALE_POLICY,
            collective_state_dict=collective_state_dict,
            allow_cross_param=allow_cross_param,
            **default,
        )
        self.backend = dist.get_backend(self.group)
        self._local_to_global_rank = [
            _dist.global_rank(self.group, r) for r in range(self.world_size)
        ]

    def handle_loss_scaling(self, enabled: bool = True) -> None:
        """Does nothing: fairscale's ``OSS`` has no loss-scaling contract. Its users pair it
        with ``ShardedGradScaler`` (Lightning 1.9's ``ddp_sharded`` does, and refuses to clip
        the gradients of an optimizer that declares the contract), also under
        :class:`oss_plus.ShardedDataParallel`; its partition keeps every param whole."""

    # ----------------------------------------------------------------- fairscale attributes
    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        """Map every param to the rank (in ``group``) that owns it."""
        return self.param_to_rank

    @property
    def _param_to_index(self) -> dict[int, int]:
        """Map ``id(param)`` to its index in the flattened global param groups."""
        return {id(p): i for i, p in enumerate(self.flat_params())}

    @property
    def _per_device_params(self) -> dict[torch.device, list[list[torch.Tensor]]]:
        """For every device, the params of each rank (frozen ones too) in ascending size."""
        result: dict[torch.device, list[list[torch.Tensor]]] = OrderedDict()
        for param, rank in self.param_to_rank.items():
            per_rank = result.setdefault(param.device, [[] for _ in range(self.world_size)])
            per_rank[rank].append(param)
        for per_rank in result.values():
            for params in per_rank:
                params.sort(key=lambda p: p.numel())
        return result

    @property
    def _local_params(self) -> list[torch.Tensor]:
        """The params this rank owns that have a gradient (computed now, never cached)."""
        return [
            p
            for per_rank in self._per_device_params.values()
            for p in per_rank[self.rank]
            if p.grad is not None
        ]

    @property
    def _default_device(self) -> torch.device:
        return self.flat_params()[0].device

    @property
    def buckets(self) -> dict[torch.device, dict[int, Bucket]]:
        """``buckets[device][rank]``: the flat buffer of ``rank``'s trainable params.

        Each :class:`~oss_plus.wire.sync.Bucket` has ``buffer`` and ``params``. fairscale supports
        one dtype per bucket only; with mixed dtypes this view shows the bucket of the first
        dtype and ``sync_buckets.buckets`` lists them all.
        """
        result: dict[torch.device, dict[int, Bucket]] = OrderedDict()
        for bucket in self.sync.buckets:
            result.setdefault(bucket.buffer.device, {}).setdefault(bucket.owner, bucket)
        return result

    @property
    def _all_states(self) -> list[dict[str, Any]]:
        """After consolidation on this rank: every rank's local state dict, rank by rank.

        fairscale's format (local indices, as each rank's inner optimizer numbers its
        params), derived from the consolidated state without copying it. Empty on ranks that
        received nothing. ``opt._all_states = []`` drops the consolidated copy.
        """
        return self._rank_state_dicts()

    @_all_states.setter
    def _all_states(self, value: list[dict[str, Any]]) -> None:
        if not isinstance(value, list) or value:
            raise ValueError(ALL_STATES_READ_ONLY.format(kind=type(value).__name__))
        self.drop_consolidated()

    def _clear_cache(self) -> None:
        """fairscale's cache reset: a no-op here (the partition and the views above are
        computed from the current plan at every read; nothing is cached)."""

    # ----------------------------------------------------------------- clipping
    def clip_grad_norm(  # type: ignore[override]
        self,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        filter_params_fn: Callable[[Any], Any] | None = None,
        *,
        group: Any | None = None,
    ) -> torch.Tensor:
        """Clip the gradients by their total norm, reduced over WORLD like fairscale.

        fairscale reduces over WORLD on purpose, so that model parallelism can count a
        param on one rank only with ``filter_params_fn``. The owned params are computed at
        every call (fairscale caches the list on first use: called before any backward or
        after ``refresh_trainable`` it clips with a stale list), and the norm is computed in
        float32/float64 by :mod:`oss_plus.amp.clip` (fairscale rounds each rank's partial norm to
        the param dtype: coarse in bf16).

        Args:
            max_norm: the largest total norm allowed.
            norm_type: ``p`` or ``float('inf')``.
            filter_params_fn: receives the params this rank owns and returns those to count.
            group: keyword-only extension: reduce over this group instead of WORLD (pass
                ``opt.group`` when several independent groups train at once).

        Returns:
            The total norm before clipping.

        .. warning:: Collective: call on every rank of WORLD (of ``group`` when given).
        """
        return super().clip_grad_norm(
            max_norm,
            norm_type,
            filter_params_fn,
            group=dist.group.WORLD if group is None else group,
        )


provide(OSS)  # what install() puts in fairscale's place
