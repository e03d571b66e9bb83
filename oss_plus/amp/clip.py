"""Gradient-norm clipping for sharded optimizers: local partial (pure) + one all_reduce + scale.

Each rank counts the gradients it is responsible for (for :class:`~oss_plus.OSS`: the params
it owns, so every gradient is counted exactly once over the group), reduces one partial with
one ``all_reduce`` and scales its gradients by ``min(1, max_norm / (total + 1e-6))``, the
coefficient of :func:`torch.nn.utils.clip_grad_norm_`.

Precision: the partial of a finite ``p`` is the sum of ``|g|**p`` over every element, built
from per-tensor norms computed in at least float32 (whatever the gradient dtype) whose
``p``-th powers are summed in float64; ``inf`` takes the max. torch's ``clip_grad_norm_``
rounds every per-tensor norm and the total to the gradient dtype (bf16 keeps 8 bits: ~0.3%
error); fairscale rounds each rank's partial to the param dtype before reducing. Here the
bf16 total is within float32 rounding of the float64 norm. The float64 sum of ``p``-th powers
limits very large ``p``: ``norm**p`` must stay within float64's range (1e-308 to 1e308).

Two ways to reduce:

* :func:`clip_sharded_` (what :meth:`oss_plus.OSS.clip_grad_norm` uses over its own group):
  every rank computes the float32 norm of each gradient it owns and writes it at the param's
  flat index of a vector; ONE ``all_reduce`` (SUM: every entry comes from exactly one rank, so
  the sum is exact) gives every rank the vector of per-param norms, from which the total is
  computed exactly as ``torch.nn.utils.clip_grad_norm_`` does. In fp32 the norm and the
  clipped gradients are bit-identical to torch's. This needs every rank to index the same
  params (true for one optimizer over one group) and to agree on which params have a
  gradient (true under DDP and for frozen params).
* :func:`clip_grad_norm_` (an explicit ``group=``, e.g. model parallelism, where ranks hold
  different params; or a ``filter_params_fn``): each rank reduces one partial, the sum of
  ``p``-th powers in float64 (or the max), with one scalar ``all_reduce``. Within 1 ulp of
  torch in fp32.

Nothing here reads a tensor on the host (no ``.item()``, no ``if`` on a tensor) unless
``error_if_nonfinite=True`` asks for a check, which every rank makes on the same total.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from oss_plus.amp.norms import (
    BAD_MAX_NORM,
    BAD_NORM_TYPE,
    NONFINITE,
    check_norm_type,
    local_partial,
    norms_and_presence,
    reduce_partial,
    result_device,
    scale_grads_,
    sharded_norms,
)
from oss_plus.planning.plan import ShardPlan
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label
from oss_plus.step.pieces import PieceTargets
from oss_plus.step.shard import LocalShard

__all__ = [
    "ShardedClip",
    "BAD_MAX_NORM",
    "BAD_NORM_TYPE",
    "NONFINITE",
    "clip_by_plan_",
    "clip_grad_norm_",
    "result_device",
    "clip_owned_",
    "clip_sharded_",
    "local_partial",
    "reduce_partial",
    "scale_grads_",
    "sharded_norms",
]

logger = logging.getLogger(__name__)


@torch.no_grad()
def clip_sharded_(
    params: Sequence[torch.Tensor],
    owned: Sequence[bool],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: Any,
    error_if_nonfinite: bool = False,
    scale_all: bool = False,
) -> torch.Tensor:
    """Clip like ``torch.nn.utils.clip_grad_norm_`` over all ``params``, each rank scaling the
    gradients it owns (every gradient it holds with ``scale_all``); the total is
    bit-identical to torch's in fp32.

    Args:
        params: every param, in the same order on every rank of ``group``.
        owned: which of ``params`` this rank owns (each param is owned by one rank).
        max_norm: the largest total norm allowed.
        norm_type: ``p`` (> 0) or ``inf``.
        group: the ranks sharing ``params``.
        error_if_nonfinite: raise on every rank when the total is NaN or inf.

    Returns:
        The float32 total norm before clipping, the same on every rank, on the gradients'
        device (:func:`result_device`).

    Raises:
        ValueError: bad ``norm_type`` or ``max_norm``.
        RuntimeError: ``error_if_nonfinite`` and the total is not finite.

    .. warning:: Collective: call on every rank of ``group``.
    """
    p = check_norm_type(norm_type)
    max_norm = _check_max_norm(max_norm)
    with label("oss_plus::clip_grad_norm"):
        norms, with_grad = norms_and_presence(params, owned, p, group)
        if len(with_grad) != len(params):
            keep = torch.tensor(with_grad, dtype=torch.long, device=norms.device)
            norms = norms.index_select(0, keep)
        total = torch.linalg.vector_norm(norms, p)
        _check_finite(total, p, error_if_nonfinite)
        grads = [
            q.grad for q, own in zip(params, owned) if (own or scale_all) and q.grad is not None
        ]
        scale_grads_(grads, max_norm, total)
    return total.to(result_device(params))


def _check_max_norm(max_norm: Any) -> float:
    value = float(max_norm)
    if not value >= 0:
        raise ValueError(BAD_MAX_NORM.format(max_norm=max_norm))
    return value


def _check_finite(total: torch.Tensor, p: float, error_if_nonfinite: bool) -> None:
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(NONFINITE.format(norm_type=p, total=float(total)))


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: Any,
    counted: Iterable[torch.Tensor] | None = None,
    error_if_nonfinite: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``params`` by the norm of the gradients counted over ``group``.

    Args:
        params: the params whose gradients this rank scales (``grad=None`` is skipped).
        max_norm: the largest total norm allowed.
        norm_type: ``p`` (> 0) or ``inf``.
        group: the ranks whose counted gradients make up the total.
        counted: the params this rank counts in the norm (default: ``params``). Together,
            the ranks of ``group`` must count every gradient exactly once.
        error_if_nonfinite: raise when the total is NaN or inf (on every rank: they all hold
            the same total; this one check reads the total on the host).
        dtype: dtype of the returned total (float32, or float64 for float64 models).
        device: where the total is returned (default: :func:`result_device` of ``params``,
            the gradients' device, as ``torch.nn.utils.clip_grad_norm_``).

    Returns:
        The total norm over ``group`` (before clipping), the same on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive or inf, or ``max_norm`` is negative/NaN.
        RuntimeError: ``error_if_nonfinite`` and the total is NaN or inf.

    Example:
        >>> total = clip_grad_norm_(owned, 1.0, group=group)  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    p = check_norm_type(norm_type)
    max_norm = _check_max_norm(max_norm)
    params = list(params)
    counted = params if counted is None else list(counted)
    with label("oss_plus::clip_grad_norm"):
        comm = _dist.comm_device(group)
        grads = [q.grad for q in counted if q.grad is not None]
        total = reduce_partial(local_partial(grads, p, comm), p, group).to(dtype)
        _check_finite(total, p, error_if_nonfinite)
        scale_grads_([q.grad for q in params if q.grad is not None], max_norm, total)
    return total.to(result_device(params) if device is None else device)


@dataclass(frozen=True)
class ClipOptions:
    """The options of :meth:`oss_plus.OSS.clip_grad_norm` beyond the norm itself.

    Attributes:
        filter_params_fn: fairscale's hook: which owned params count in the norm.
        group: reduce over this group instead of the optimizer's.
        error_if_nonfinite: raise on every rank when the total is NaN or inf.
        scale_all: scale every gradient this rank holds, not only its own.
    """

    filter_params_fn: Callable[[list[torch.Tensor]], Any] | None = None
    group: Any | None = None
    error_if_nonfinite: bool = False
    scale_all: bool = False


def clip_owned_(
    params: list[torch.Tensor],
    owned_mask: Sequence[bool],
    max_norm: float,
    norm_type: float,
    optimizer_group: Any,
    options: ClipOptions = ClipOptions(),
) -> torch.Tensor:
    """Clip the grads of a sharded optimizer (what :meth:`oss_plus.OSS.clip_grad_norm` runs).

    Over the optimizer's own group without a filter: :func:`clip_sharded_` (bit-identical to
    torch's in fp32). Otherwise partial sums over ``group`` (default the optimizer's) with
    :func:`clip_grad_norm_`, counting ``filter_params_fn(owned)`` and scaling every owned grad
    (every grad of ``params`` with ``scale_all``).

    .. warning:: Collective: call on every rank of ``group`` (default ``optimizer_group``).
    """
    fn, group, nonfinite = options.filter_params_fn, options.group, options.error_if_nonfinite
    if fn is None and (group is None or group is optimizer_group):
        return clip_sharded_(
            params,
            owned_mask,
            max_norm,
            norm_type,
            group=optimizer_group,
            error_if_nonfinite=nonfinite,
            scale_all=options.scale_all,
        )
    owned = [p for p, own in zip(params, owned_mask) if own]
    counted = owned if fn is None else list(fn(list(owned)))
    wide = any(p.dtype == torch.float64 for p in params)
    return clip_grad_norm_(
        params if options.scale_all else owned,
        max_norm,
        norm_type,
        group=optimizer_group if group is None else group,
        counted=counted,
        error_if_nonfinite=nonfinite,
        dtype=torch.float64 if wide else torch.float32,
        device=result_device(params),  # the same on every rank, owned grads or not
    )


def _piece_filter(
    targets: PieceTargets, user_fn: Callable[[list[torch.Tensor]], Any] | None
) -> Callable[[list[torch.Tensor]], Any] | None:
    """``user_fn`` (which sees params, fairscale's hook) made to take and give the tensors
    this rank steps (a split param's piece in place of the param)."""
    if user_fn is None:
        return None
    params, stepped = targets.params, targets.targets()
    param_of = {id(t): p for t, p in zip(stepped, params)}
    target_of = {id(p): t for t, p in zip(stepped, params)}

    def fn(mine: list[torch.Tensor]) -> list[torch.Tensor]:
        return [target_of[id(p)] for p in user_fn([param_of[id(t)] for t in mine])]

    return fn


def clip_by_plan_(
    plan: ShardPlan,
    targets: PieceTargets,
    max_norm: float,
    norm_type: float,
    optimizer_group: Any,
    options: ClipOptions = ClipOptions(),
) -> torch.Tensor:
    """What :meth:`oss_plus.OSS.clip_grad_norm` runs: every rank counts and scales what
    ``plan`` gives it (:func:`clip_owned_`).

    When the plan splits params (the flat rule), each rank counts and scales the gradient
    slices of its pieces (``targets``: their gradients are slices of the params' gradients,
    or the pieces' handed-over ones), with float64 partial sums and one ``all_reduce``;
    ``filter_params_fn`` still sees params, never pieces.

    With ``scale_all`` (this rank's ``requires_grad`` changed since the plan was made: the
    next ``step()`` repartitions), the norm is the same but this rank scales every gradient
    it holds, so that a param's new owner steps with a clipped gradient.

    .. warning:: Collective: call on every rank of ``group`` (default ``optimizer_group``).
    """
    rank = targets.rank
    if not plan.split:
        owned = [owner == rank for owner in plan.owners]
        return clip_owned_(targets.params, owned, max_norm, norm_type, optimizer_group, options)
    stepped = targets.targets()
    pieces = [t for i, t in enumerate(stepped) if plan.piece(rank, i) is not None]
    fn = _piece_filter(targets, options.filter_params_fn)
    targets.set_grads()
    try:
        counted = pieces if fn is None else list(fn(list(pieces)))
        # with scale_all: the params' gradients (the pieces' are views of them) and the
        # handed-over ones; else the pieces' own
        given = [targets.tensors[i] for i in targets.given]
        wide = any(p.dtype == torch.float64 for p in stepped)
        return clip_grad_norm_(
            [*targets.params, *given] if options.scale_all else pieces,
            max_norm,
            norm_type,
            group=optimizer_group if options.group is None else options.group,
            counted=counted,
            error_if_nonfinite=options.error_if_nonfinite,
            dtype=torch.float64 if wide else torch.float32,
            device=result_device(stepped),  # the same on every rank, owned grads or not
        )
    finally:
        targets.clear_grads()


class ShardedClip:
    """``clip_grad_norm`` of :class:`oss_plus.OSS`, a mixin built on its extension contract
    (``local_shard``, ``settle()``, ``trainability_changed()``, ``group``)."""

    group: Any
    # provided by oss_plus.OSS
    settle: Callable[[], None]
    trainability_changed: Callable[[], bool]
    if TYPE_CHECKING:  # properties of oss_plus.OSS

        @property
        def local_shard(self) -> LocalShard: ...
        @property
        def step_count(self) -> int: ...

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Callable[[list[torch.Tensor]], Any] | None = None,
        *,
        group: Any | None = None,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip the gradients by their total norm over the group, like ``clip_grad_norm_``.

        Each rank scales the gradients of the params it owns now (after a trainability
        change, which the next :meth:`step` repartitions, every gradient it holds); one
        ``all_reduce`` gives every rank the same total. Over the optimizer's group without
        ``filter_params_fn`` the total is bit-identical to ``torch.nn.utils.clip_grad_norm_``
        in fp32 (exact to float32 on bf16/fp16 grads); with ``group=`` or
        ``filter_params_fn``, float64 partial sums are reduced instead. Ranks must agree on
        which params have a gradient (as under DDP).
        See :mod:`oss_plus.amp.clip`.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: ``p`` (> 0) or ``float('inf')``.
            filter_params_fn: receives the params this rank owns, returns those to count
                (fairscale's hook for model parallelism); every owned gradient is scaled.
            group: reduce over this group instead of the optimizer's (model parallelism).
            error_if_nonfinite: raise RuntimeError on every rank when the total is NaN/inf.

        Returns:
            The total norm before clipping (float32; float64 for float64 models), on the
            gradients' device on every path (gloo or NCCL), as ``clip_grad_norm_`` returns it.

        Raises:
            ValueError: bad ``norm_type`` or ``max_norm``.
            RuntimeError: ``error_if_nonfinite`` and the total is not finite.

        Example:
            >>> scaler.unscale_(opt); opt.clip_grad_norm(1.0); scaler.step(opt)  # doctest: +SKIP

        .. warning:: Collective: call on every rank of ``group`` (a call on some ranks only
            raises there within the arrival timeout, :mod:`oss_plus.runtime.arrival`).
        """
        over = self.group if group is None else group
        with _arrival.entry(over, "clip_grad_norm()", steps=self.step_count):
            self.settle()
            shard = self.local_shard
            changed = self.trainability_changed()  # the next step() repartitions
            options = ClipOptions(filter_params_fn, group, error_if_nonfinite, scale_all=changed)
            return clip_by_plan_(
                shard.plan, shard.targets, max_norm, norm_type, self.group, options
            )
