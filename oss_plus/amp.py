"""A loss scaler whose skip/scale decisions are identical on every rank of a sharded optimizer.

``torch.amp.GradScaler`` decides from the gradients of one process whether ``step()`` runs.
With a sharded optimizer every rank must step (the step ends in broadcasts), so when an
inf/NaN appears on one rank only (no DDP averaging, e.g. gradient accumulation, or a bad
batch) the plain scaler skips on that rank and the others wait in the broadcast forever
(fairscale defect #9), and the scales of the ranks drift apart.

:class:`ShardedGradScaler` changes one thing: after unscaling, the found-inf flag is
MAX-reduced over the optimizer's group, so every rank skips the same steps and updates the
scale identically. Each rank checks and unscales *all* its gradients (the optimizer's global
param groups), not only those it owns: an inf anywhere means the scale is too high.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from oss_plus import _dist
from oss_plus._trace import label
from oss_plus.plan import ShardPlan

__all__ = ["ShardedGradScaler"]

logger = logging.getLogger(__name__)


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that agrees on inf/NaN over the optimizer's process group.

    For :class:`~oss_plus.OSS` (and ``ZeroRedundancyOptimizer``) optimizers, :meth:`unscale_`
    (also run by ``step`` when not called first) all-reduces the found-inf flag over the
    optimizer's group, so ``step()`` is skipped on every rank or on none and ``update()``
    moves every rank's scale the same way. For any other optimizer it is exactly
    ``torch.amp.GradScaler`` (no communication), unless ``group`` is given.

    Args:
        device: device type of the scale, as for ``torch.amp.GradScaler`` (``"cuda"``,
            ``"cpu"``, ...).
        init_scale: initial scale factor.
        growth_factor: factor applied to the scale after ``growth_interval`` clean steps.
        backoff_factor: factor applied to the scale after a step with inf/NaN.
        growth_interval: clean steps between growths.
        enabled: False makes every method a pass-through.
        group: keyword-only; reduce over this group for every optimizer instead of the
            optimizer's own (also makes plain optimizers agree over ``group``).

    Example:
        >>> scaler = ShardedGradScaler("cuda")  # doctest: +SKIP
        >>> with torch.autocast("cuda", dtype=torch.float16):  # doctest: +SKIP
        ...     loss = model(x).sum()
        >>> scaler.scale(loss).backward()  # doctest: +SKIP
        >>> scaler.unscale_(opt); opt.clip_grad_norm(1.0)  # doctest: +SKIP
        >>> scaler.step(opt); scaler.update()  # doctest: +SKIP

    .. warning:: Collective: for OSS optimizers (or with ``group``), call ``unscale_`` and
       ``step`` on every rank of the group.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        group: Any | None = None,
    ) -> None:
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self.group = group

    def _group_of(self, optimizer: torch.optim.Optimizer) -> Any | None:
        """Return the group whose ranks must agree for ``optimizer`` (None: no reduction)."""
        if self.group is not None:
            return self.group
        if isinstance(getattr(optimizer, "plan", None), ShardPlan):  # oss_plus.OSS and adapters
            return optimizer.group  # type: ignore[attr-defined]
        # torch's class can only exist once its module was imported: no import here
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
        if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
            return _dist.resolve_group(optimizer.process_group)
        return None

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale and check every local gradient, then MAX-reduce the flag over the group.

        Returns one entry (the agreed flag on ``found_inf``'s device), also on a rank that
        has no gradient at all. An error unscaling on one rank (e.g. fp16 gradients) is
        raised on every rank instead of leaving the others in the reduction; reading that
        error flag is one host sync, which ``step()`` makes anyway when it reads the flag.

        .. warning:: Collective: call on every rank of the optimizer's group.
        """
        group = self._group_of(optimizer)
        if group is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        error: Exception | None = None
        per_device: dict[torch.device, torch.Tensor] = {}
        try:
            per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            _unscale_pieces(optimizer, inv_scale, per_device)
        except (ValueError, AssertionError) as exc:
            error = exc
        found = sum(int(bool(flag.item())) for flag in per_device.values())
        with label("oss_plus::found_inf_all_reduce"):
            found = max(_dist.agree(error, group, value=found))
        return {found_inf.device: torch.full_like(found_inf, float(found))}


@torch.no_grad()
def _unscale_pieces(
    optimizer: Any, inv_scale: torch.Tensor, per_device: dict[torch.device, torch.Tensor]
) -> None:
    """Unscale and check the piece gradients an ``OSS`` was handed (the flat rule under
    ZeRO-2: ``OSS.set_piece_grad``), which no param's ``.grad`` holds."""
    pieces = getattr(optimizer, "piece_grads", None)
    grads = list(pieces().values()) if callable(pieces) else []
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, tensors in by_device.items():
        if device not in per_device:
            per_device[device] = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, per_device[device], inv_scale.to(device)
        )
