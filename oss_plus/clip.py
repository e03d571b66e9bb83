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
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus import _dist

__all__ = [
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

#: Added to the total norm before dividing, as torch's ``clip_grad_norm_`` does.
EPS = 1e-6
#: Devices whose ``torch._foreach_*`` kernels are used (others loop over tensors).
_FOREACH_DEVICES = ("cpu", "cuda", "xpu")

#: Raised on every rank when ``error_if_nonfinite=True`` and the total norm is NaN or inf.
NONFINITE = (
    "the total norm of order {norm_type} of the gradients is {total}: it can not be clipped. "
    "A NaN/inf gradient usually means the loss scale is too high (ShardedGradScaler skips such "
    "steps on every rank) or the model diverged; pass error_if_nonfinite=False to scale by the "
    "non-finite norm anyway"
)
#: Raised for a ``norm_type`` that is not a positive number or inf.
BAD_NORM_TYPE = (
    "norm_type must be a positive number or inf (1.0, 2.0, float('inf'), ...), got {norm_type!r}"
)
#: Raised for a ``max_norm`` that is negative or NaN.
BAD_MAX_NORM = "max_norm must be a non-negative number, got {max_norm!r}"


def result_device(params: Sequence[torch.Tensor]) -> torch.device:
    """Return where a clip returns its total: the device of the first gradient, as
    ``torch.nn.utils.clip_grad_norm_`` does (the first param's when none has one).

    Every rank computes the same device for the same params (a rank holding no gradient,
    as under ZeRO-2, falls back to the params' device), whatever device the collectives use.

    Example:
        >>> result_device([torch.zeros(2)])
        device(type='cpu')
    """
    for p in params:
        if p.grad is not None:
            return p.grad.device
    return params[0].device if params else torch.device("cpu")


def _check_norm_type(norm_type: Any) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(BAD_NORM_TYPE.format(norm_type=norm_type)) from None
    if not p > 0:  # also rejects NaN
        raise ValueError(BAD_NORM_TYPE.format(norm_type=norm_type))
    return p


_Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]


def _grouped(tensors: Iterable[torch.Tensor]) -> _Groups:
    """Group tensors by (device, dtype), keeping their order inside each group."""
    groups: _Groups = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _tensor_norms(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Per-tensor ``p``-norms computed and returned in at least float32 (tensors of one
    device and dtype)."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    if tensors[0].device.type in _FOREACH_DEVICES:
        return list(torch._foreach_norm(tensors, p, dtype=dtype))
    return [torch.linalg.vector_norm(t, p, dtype=dtype) for t in tensors]


@torch.no_grad()
def local_partial(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """Return this rank's contribution to the total norm, a float64 scalar on ``device``.

    Pure (no communication). For a finite ``p`` the partial is ``sum(|g|**p)`` over every
    element of ``grads``; for ``inf`` it is ``max(|g|)``. No gradients give 0.

    Args:
        grads: the gradients to count (any devices and floating dtypes).
        norm_type: ``p`` (> 0) or ``inf``.
        device: where the partial is returned (the device collectives use).

    Returns:
        A 0-dim float64 tensor on ``device``.

    Example:
        >>> local_partial([torch.tensor([3.0, 4.0])], 2.0, torch.device("cpu"))
        tensor(25., dtype=torch.float64)
    """
    p = _check_norm_type(norm_type)
    partial = torch.zeros((), dtype=torch.float64, device=device)
    for tensors in _grouped(grads).values():
        norms = torch.stack(_tensor_norms(tensors, p)).to(device=device, dtype=torch.float64)
        if math.isinf(p):
            partial = torch.maximum(partial, norms.max())  # maximum propagates NaN
        else:
            partial = partial + norms.pow(p).sum()
    return partial


def reduce_partial(partial: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """All-reduce the partials of every rank of ``group`` into the total norm (float64).

    One ``all_reduce``: SUM of the ``p``-th powers, or MAX for ``inf`` (with a NaN flag next
    to the max, since a MAX reduction may drop NaN). Every rank gets the same total.

    .. warning:: Collective: call on every rank of ``group``.
    """
    p = _check_norm_type(norm_type)
    if math.isinf(p):
        nan = partial.isnan()
        packed = torch.stack([torch.where(nan, torch.zeros_like(partial), partial), nan.double()])
        with _dist.released(group, packed):
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])
    total = partial.clone()
    with _dist.released(group, total):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if p == 1.0:
        return total
    return total.sqrt() if p == 2.0 else total.pow(1.0 / p)


@torch.no_grad()
def scale_grads_(
    grads: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor
) -> torch.Tensor:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``; return that factor.

    The factor is a tensor (clamped, never compared on the host), so nothing waits for the
    device. A NaN total scales by NaN, as torch does.
    """
    coef = torch.clamp(max_norm / (total + EPS), max=1.0)
    for (device, _), tensors in _grouped(grads).items():
        factor = coef.to(device)
        if device.type in _FOREACH_DEVICES:
            torch._foreach_mul_(tensors, factor)
        else:
            for t in tensors:
                t.mul_(factor)
    return coef


@torch.no_grad()
def sharded_norms(
    params: Sequence[torch.Tensor], owned: Sequence[bool], norm_type: float, group: Any
) -> torch.Tensor:
    """Return the float32 norm of every param's gradient, gathered with one ``all_reduce``.

    Args:
        params: every param, in the same (flat) order on every rank of ``group``.
        owned: ``owned[i]`` is True on exactly one rank: the rank that measures ``params[i]``.
        norm_type: ``p`` (> 0) or ``inf``.
        group: the ranks that share ``params``.

    Returns:
        A float32 vector on the communication device; 0 where no rank measured a gradient.

    .. warning:: Collective: call on every rank of ``group``.
    """
    return _norms_and_presence(params, owned, norm_type, group)[0]


def _norms_and_presence(
    params: Sequence[torch.Tensor], owned: Sequence[bool], norm_type: float, group: Any
) -> tuple[torch.Tensor, list[int]]:
    """:func:`sharded_norms`, plus the indices of the params whose owner holds a gradient.

    A rank holding every gradient (DDP) knows the answer locally.

    The owner's view decides (under ZeRO-2 only the owner holds the gradient); both travel
    in the same ``all_reduce``.
    """
    p = _check_norm_type(norm_type)
    device = _dist.comm_device(group)
    count = len(params)
    vector = torch.zeros(2 * count, dtype=torch.float32, device=device)
    mine = [i for i, (q, own) in enumerate(zip(params, owned)) if own and q.grad is not None]
    if mine:
        vector[count + torch.tensor(mine, dtype=torch.long)] = 1.0
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in mine:
        grad = params[i].grad
        assert grad is not None
        by_key.setdefault((grad.device, grad.dtype), []).append(i)
    for indices in by_key.values():
        grads = [params[i].grad for i in indices]
        norms = _tensor_norms(grads, p)  # type: ignore[arg-type]
        index = torch.tensor(indices, dtype=torch.long, device=device)
        vector.index_copy_(0, index, torch.stack(norms).to(device=device, dtype=torch.float32))
    with _dist.released(group, vector):
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
    if all(q.grad is not None for q in params):  # every rank holds every grad (DDP): no sync
        return vector[:count], list(range(count))
    present = [i for i, flag in enumerate(vector[count:].tolist()) if flag]
    return vector[:count], present


@torch.no_grad()
def clip_sharded_(
    params: Sequence[torch.Tensor],
    owned: Sequence[bool],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: Any,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip like ``torch.nn.utils.clip_grad_norm_`` over all ``params``, each rank scaling the
    gradients it owns; the total is bit-identical to torch's in fp32.

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
    p = _check_norm_type(norm_type)
    max_norm = _check_max_norm(max_norm)
    with torch.profiler.record_function("oss_plus::clip_grad_norm"):
        norms, with_grad = _norms_and_presence(params, owned, p, group)
        if len(with_grad) != len(params):
            keep = torch.tensor(with_grad, dtype=torch.long, device=norms.device)
            norms = norms.index_select(0, keep)
        total = torch.linalg.vector_norm(norms, p)
        _check_finite(total, p, error_if_nonfinite)
        grads = [q.grad for q, own in zip(params, owned) if own and q.grad is not None]
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
    p = _check_norm_type(norm_type)
    max_norm = _check_max_norm(max_norm)
    params = list(params)
    counted = params if counted is None else list(counted)
    with torch.profiler.record_function("oss_plus::clip_grad_norm"):
        comm = _dist.comm_device(group)
        grads = [q.grad for q in counted if q.grad is not None]
        total = reduce_partial(local_partial(grads, p, comm), p, group).to(dtype)
        _check_finite(total, p, error_if_nonfinite)
        scale_grads_([q.grad for q in params if q.grad is not None], max_norm, total)
    return total.to(result_device(params) if device is None else device)


def clip_owned_(
    params: list[torch.Tensor],
    owned_mask: Sequence[bool],
    max_norm: float,
    norm_type: float,
    optimizer_group: Any,
    *,
    filter_params_fn: Callable[[list[torch.Tensor]], Any] | None = None,
    group: Any | None = None,
    error_if_nonfinite: bool = False,
    partial: bool = False,
) -> torch.Tensor:
    """Clip the grads of a sharded optimizer (what :meth:`oss_plus.OSS.clip_grad_norm` runs).

    Over the optimizer's own group without a filter: :func:`clip_sharded_` (bit-identical to
    torch's in fp32). Otherwise (or with ``partial``: ``params`` holds pieces of params, as
    under the flat rule) partial sums over ``group`` (default the optimizer's) with
    :func:`clip_grad_norm_`, counting ``filter_params_fn(owned)`` and scaling every owned grad.

    .. warning:: Collective: call on every rank of ``group`` (default ``optimizer_group``).
    """
    if not partial and filter_params_fn is None and (group is None or group is optimizer_group):
        return clip_sharded_(
            params,
            owned_mask,
            max_norm,
            norm_type,
            group=optimizer_group,
            error_if_nonfinite=error_if_nonfinite,
        )
    owned = [p for p, own in zip(params, owned_mask) if own]
    counted = owned if filter_params_fn is None else list(filter_params_fn(list(owned)))
    wide = any(p.dtype == torch.float64 for p in params)
    return clip_grad_norm_(
        owned,
        max_norm,
        norm_type,
        group=optimizer_group if group is None else group,
        counted=counted,
        error_if_nonfinite=error_if_nonfinite,
        dtype=torch.float64 if wide else torch.float32,
        device=result_device(params),  # the same on every rank, owned grads or not
    )
