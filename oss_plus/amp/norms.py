"""The norm arithmetic of :mod:`oss_plus.amp.clip`: per-tensor norms, a rank's partial, the
reduction of the partials, the exact vector of per-param norms, and the scaling.

Nothing here reads a tensor on the host unless ranks must learn which params have a
gradient (ZeRO-2, :func:`norms_and_presence`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime import dist as _dist

__all__ = [
    "BAD_MAX_NORM",
    "BAD_NORM_TYPE",
    "NONFINITE",
    "check_norm_type",
    "local_partial",
    "norms_and_presence",
    "reduce_partial",
    "result_device",
    "scale_grads_",
    "sharded_norms",
    "tensor_norms",
]

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


def check_norm_type(norm_type: Any) -> float:
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


def tensor_norms(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
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
    p = check_norm_type(norm_type)
    partial = torch.zeros((), dtype=torch.float64, device=device)
    for tensors in _grouped(grads).values():
        norms = torch.stack(tensor_norms(tensors, p)).to(device=device, dtype=torch.float64)
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
    p = check_norm_type(norm_type)
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
    return norms_and_presence(params, owned, norm_type, group)[0]


def norms_and_presence(
    params: Sequence[torch.Tensor], owned: Sequence[bool], norm_type: float, group: Any
) -> tuple[torch.Tensor, list[int]]:
    """:func:`sharded_norms`, plus the indices of the params whose owner holds a gradient.

    A rank holding every gradient (DDP) knows the answer locally.

    The owner's view decides (under ZeRO-2 only the owner holds the gradient); both travel
    in the same ``all_reduce``.
    """
    p = check_norm_type(norm_type)
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
        norms = tensor_norms(grads, p)  # type: ignore[arg-type]
        index = torch.tensor(indices, dtype=torch.long, device=device)
        vector.index_copy_(0, index, torch.stack(norms).to(device=device, dtype=torch.float32))
    with _dist.released(group, vector):
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
    if all(q.grad is not None for q in params):  # every rank holds every grad (DDP): no sync
        return vector[:count], list(range(count))
    present = [i for i, flag in enumerate(vector[count:].tolist()) if flag]
    return vector[:count], present
