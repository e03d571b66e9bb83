"""Loss scaling for a sharded optimizer: skip/scale decisions identical on every rank.

``torch.amp.GradScaler`` decides from the gradients of one process whether ``step()`` runs.
With a sharded optimizer every rank must step (the step ends in broadcasts), so when an
inf/NaN appears on one rank only (no DDP averaging, e.g. gradient accumulation, or a bad
batch; under ZeRO-2 each rank holds only its own gradients) the plain scaler skips on that
rank and the others wait in the broadcast forever (fairscale defect #9 with fairscale's and
torch's sharded optimizers), and the scales of the ranks drift apart.

:class:`ShardedGradScaler` changes one thing: after unscaling, the found-inf flag is
MAX-reduced over the optimizer's group, so every rank skips the same steps and updates the
scale identically. Each rank checks and unscales *all* its gradients (the optimizer's global
param groups), not only those it owns: an inf anywhere means the scale is too high.

:class:`ScalerContract` is the other side, a mixin of :class:`oss_plus.OSS`: torch's
contract for optimizers that handle scaling themselves (``_step_supports_amp_scaling``,
as torch's fused optimizers). A plain ``torch.amp.GradScaler`` then hands the optimizer its
scale (``grad_scale``) and what it found (``found_inf``) instead of unscaling and deciding
alone; ``OSS.step`` unscales and checks every gradient, the pieces of cut params
(:meth:`oss_plus.OSS.piece_grads`) included, and agrees with every rank of its group
whether to step (:func:`scaled_step_skips`).
"""

from __future__ import annotations

import logging
import sys
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from oss_plus.planning.plan import ShardPlan
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "PIECES_NOT_UNSCALED",
    "SCALES_WOULD_DIFFER",
    "ScalerContract",
    "ShardedGradScaler",
    "scaled_step_skips",
]

logger = logging.getLogger(__name__)

#: Raised on every rank, before any update, when a ``torch.amp.GradScaler`` unscaled an
#: optimizer holding piece gradients (:meth:`oss_plus.OSS.piece_grads`), which it cannot see.
PIECES_NOT_UNSCALED = (
    "torch.amp.GradScaler.unscale_() unscaled the .grad of the optimizer's params but not the "
    "gradients of the pieces of cut params that ShardedDataParallel with "
    "partition_rule='flat' hands to the optimizer (OSS.piece_grads(), no .grad holds them), "
    "so they are still scaled (and a clip between unscale_() and step() saw them scaled). "
    "Use oss_plus.ShardedGradScaler, a drop-in for torch.amp.GradScaler that unscales them "
    "too, or call scaler.step(opt) without unscale_() (the optimizer then unscales them)"
)
#: Raised on every rank, before any update, when the ranks' ``torch.amp.GradScaler`` found
#: inf/NaN on some ranks only: their ``update()`` would move the scales apart.
SCALES_WOULD_DIFFER = (
    "inf/NaN gradients on some ranks of the optimizer's group: the torch.amp.GradScaler of "
    "{blind} saw none (each rank checks only the gradients it holds), so its update() "
    "would keep the loss scale that the others back off, and the ranks would scale their "
    "losses differently from the next iteration on. The step was skipped on every rank. "
    "Use oss_plus.ShardedGradScaler, a drop-in for torch.amp.GradScaler whose found-inf flag "
    "is agreed by every rank"
)


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

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """As ``torch.amp.GradScaler.step``: unscale (unless :meth:`unscale_` ran), then call
        ``optimizer.step(*args, **kwargs)`` unless some rank found inf/NaN.

        An :class:`~oss_plus.OSS` takes torch's contract for optimizers that unscale
        themselves (:class:`ScalerContract`), which a plain ``GradScaler`` uses; this scaler
        unscales and agrees itself instead (one reduction, in :meth:`unscale_`) and steps it
        as torch's scaler steps any other optimizer, so the optimizer has nothing left to do.

        .. warning:: Collective: for OSS optimizers (or with ``group``), call on every rank.
        """
        if not (self.is_enabled() and isinstance(optimizer, ScalerContract)) or "closure" in kwargs:
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = None
        if not sum(flag.item() for flag in state["found_inf_per_device"].values()):
            result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

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


class ScalerContract:
    """torch's contract for optimizers that handle loss scaling themselves, a mixin of
    :class:`oss_plus.OSS` (built on its public members: ``group``, ``param_groups``,
    :meth:`~oss_plus.OSS.piece_grads`).

    ``torch.amp.GradScaler.step`` reads ``_step_supports_amp_scaling`` (torch's fused
    optimizers set it too): instead of unscaling the gradients and skipping ``step()`` on
    its own, it checks the gradients it sees, sets ``grad_scale`` (the scale; None after
    :meth:`~torch.amp.GradScaler.unscale_`) and ``found_inf`` on the optimizer and calls
    ``step()``. There :func:`scaled_step_skips` unscales what is left, the pieces of cut
    params included, and agrees with every rank whether to step.

    Off by default: under ZeRO-1 (DDP + ``OSS``) every rank holds every averaged gradient, so
    torch's classic path (each rank unscales and checks them, then steps or skips) is exact
    and the ranks agree; and frameworks read the flag too (Lightning refuses to clip the
    gradients of an optimizer that declares it, as it does for torch's fused ones).
    :class:`oss_plus.ShardedDataParallel` turns it on (:meth:`handle_loss_scaling`): there
    each rank holds only its own gradients, so its scaler alone would see an overflow on
    one rank only, and the flat rule's piece gradients are no ``.grad`` at all.
    """

    #: torch.amp.GradScaler.step hands ``grad_scale`` and ``found_inf`` to ``step()`` when
    #: True (an instance attribute set by :meth:`handle_loss_scaling`).
    _step_supports_amp_scaling = False

    def handle_loss_scaling(self, enabled: bool = True) -> None:
        """Declare (or withdraw) torch's contract for optimizers that unscale in their own
        step, so that a plain ``torch.amp.GradScaler`` hands ``step()`` its scale and
        found-inf flag (see the class doc). :class:`oss_plus.ShardedDataParallel` calls it;
        call it yourself under ZeRO-1 when the ranks' gradients are not averaged (then an
        overflow on one rank raises on every rank instead of leaving the others waiting).
        Not collective; do it on every rank alike.
        """
        self._step_supports_amp_scaling = enabled

    def _scaled_step_skips(self) -> bool:
        """Whether a grad scaler steps this optimizer and some rank found inf/NaN (then
        every rank skips); False without a scaler, at no cost. See :func:`scaled_step_skips`.

        .. warning:: Collective under a scaler: call on every rank of ``group``.
        """
        if getattr(self, "found_inf", None) is None:
            return False
        return scaled_step_skips(self)


def scaled_step_skips(optimizer: Any) -> bool:
    """The step of an optimizer a ``torch.amp.GradScaler`` hands ``grad_scale`` and
    ``found_inf`` (:class:`ScalerContract`): unscale, check, agree; return whether to skip.

    With ``grad_scale`` (``scaler.step()`` alone) the scaler only checked the ``.grad`` of
    the params: every ``.grad`` and every piece gradient is unscaled here and checked, as
    ``GradScaler.unscale_`` does (same kernel, same reciprocal, so the results are the
    unsharded optimizer's bit for bit). Without it (``unscale_()`` ran) the ``.grad`` are
    unscaled; piece gradients, which the scaler cannot see, are refused. Then one
    ``all_gather`` over ``optimizer.group``: whether each rank's scaler found inf/NaN, and
    whether anything this rank holds is non-finite. Two host reads (the local flags, then
    every rank's); torch's classic path reads its flag once.

    Returns:
        True when any rank found inf/NaN: every rank skips the step.

    Raises:
        RuntimeError: on every rank, before any update: :data:`PIECES_NOT_UNSCALED`, or
            :data:`SCALES_WOULD_DIFFER` when inf/NaN was found but not by every rank's
            scaler (its ``update()`` would not back off).
        ValueError: fp16 gradients (as ``GradScaler.unscale_``), on every rank.

    .. warning:: Collective: call on every rank of ``optimizer.group``.
    """
    grad_scale: torch.Tensor | None = getattr(optimizer, "grad_scale", None)
    handed: torch.Tensor = optimizer.found_inf
    error: Exception | None = None
    found = torch.zeros((), dtype=torch.float32, device=handed.device)
    try:
        if grad_scale is not None:
            grads = _param_grads(optimizer.param_groups)
            pieces = optimizer.piece_grads().values()
            found = _unscale(chain(grads, pieces), grad_scale, handed.device)
        elif optimizer.piece_grads():
            raise RuntimeError(PIECES_NOT_UNSCALED)
    except (ValueError, RuntimeError) as exc:
        error = exc
    seen, held = (bool(v) for v in torch.stack([handed.float().sum(), found]).tolist())
    try:
        with label("oss_plus::found_inf_all_gather"):
            rows = _dist.agree(error, optimizer.group, value=int(seen) | int(held) << 1)
        blind = [rank for rank, row in enumerate(rows) if not row & 1]
        if any(rows) and blind:
            named = _dist.name_ranks(_dist.group_members(optimizer.group), blind)
            raise RuntimeError(SCALES_WOULD_DIFFER.format(blind=named))
    except Exception:
        _forget_scaler(optimizer)  # torch deletes them only after a step that returned
        raise
    return any(rows)


def _forget_scaler(optimizer: Any) -> None:
    """Drop ``grad_scale`` and ``found_inf``: left there, the next ``GradScaler.step``
    would multiply its scale by the stale one."""
    vars(optimizer).pop("grad_scale", None)
    vars(optimizer).pop("found_inf", None)


def _param_grads(param_groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Every param's ``.grad`` (a sparse one coalesced in place, as its values are unscaled)."""
    grads = []
    for group in param_groups:
        for param in group["params"]:
            if param.grad is not None and param.grad.is_sparse:
                param.grad = param.grad.coalesce()
            if param.grad is not None:
                grads.append(param.grad)
    return grads


@torch.no_grad()
def _unscale(
    grads: Iterable[torch.Tensor], grad_scale: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Divide ``grads`` by ``grad_scale`` in place as ``GradScaler.unscale_`` does (the
    reciprocal taken in float64 off MPS, torch's kernel per device and dtype); return
    whether any was non-finite (0-dim, on ``device``; no host read)."""
    mps = grad_scale.device.type == "mps"
    inv = grad_scale.reciprocal() if mps else grad_scale.double().reciprocal().float()
    batches: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        values = grad.values() if grad.is_sparse else grad
        batches.setdefault((values.device, values.dtype), []).append(values)
    flags: dict[torch.device, torch.Tensor] = {}
    for (device, _), tensors in batches.items():
        flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv.to(device))
    found = torch.zeros((), dtype=torch.float32, device=device)
    for flag in flags.values():
        found += flag.to(device, non_blocking=True)
    return found
