"""Whether an optimizer's update of one param reads the others: a probe run once, on copies.

Sharding steps each param on its owner, with only the owner's params in the inner optimizer.
That is the unsharded algorithm exactly when the update of every param reads only that
param's gradient, state and hyperparameters. Optimizers that size their step from sums over
every param (Prodigy's and D-Adaptation's ``d``), or that normalise by a norm over all of them,
would run a different algorithm on each rank, silently. No list of class names can know every
such optimizer, so :func:`probe` asks the optimizer itself, with two witnesses
(:mod:`oss_plus.step.probe` runs them):

1. **Where every value comes from** (:mod:`oss_plus.step.probe.trace`): the user's optimizer
   (the same constructor and hyperparameters) is stepped over small copies of two of the
   model's params, in one group and in two, in both orders, with gradients that warm up, then
   cross any clipping threshold, then shrink, while every op is traced. Its update is shown
   to be per param when no param, state value, param-group value or state kept for no param
   holds a value computed from another param, no value computed from two params is read on
   the host (``.item()``, ``float()``, ``bool()``, a comparison), and no random generator's
   draws reach two params. This does not depend on the size of a coupling nor on when it
   first moves a value: a sum over the params is seen at the first step that computes it.
2. **The values**: the same optimizer over each copy alone and over both, compared bit for
   bit (the params and the group values), in both orders.

Anything that cannot be shown is refused, with its reason: a step that raises on the probe
(with gradients set before it and a closure, and again with gradients that carry their
graph), a constructor that refuses the probe's params, a probe that fails. The refusal names
``allow_cross_param=True`` as the way out.

The probe runs at construction, before any param changes, on tensors the user never sees;
it draws no number from the global random generators that the training sees, and a step
therefore costs nothing: :func:`oss_plus.OSS.step` is unchanged. Its cost is measured in
``docs/optimizers.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from oss_plus.state.index import NOT_HYPER
from oss_plus.step import named as _named
from oss_plus.step.pieces import unwrap_partial
from oss_plus.step.probe.runs import NotBuilt, ProbeParam
from oss_plus.step.probe.verdict import (
    CROSS_PARAM,
    RANDOM,
    UNSHOWN,
    Coupling,
    listed,
    verdict,
)

__all__ = [
    "CROSS_PARAM",
    "RANDOM",
    "Coupling",
    "UNSHOWN",
    "check",
    "probe",
    "refuse_cross_param",
]

logger = logging.getLogger(__name__)


def _chosen(
    param_groups: Sequence[dict[str, Any]], hyper: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[ProbeParam]:
    """The first two trainable params, each with its group's hyperparameters and a name."""
    found: list[ProbeParam] = []
    index = 0
    for group in param_groups:
        names = group.get("param_names") or []
        for i, p in enumerate(group["params"]):
            if p.requires_grad:
                name = f"param {index}" + (f" ({names[i]!r})" if i < len(names) else "")
                found.append(ProbeParam(hyper(group), p, name, 2 * len(found) + 1))
                if len(found) == 2:
                    return found
            index += 1
    return found


def probe(
    constructor: Callable[..., Optimizer],
    defaults: dict[str, Any],
    param_groups: Sequence[dict[str, Any]],
    hyper: Callable[[dict[str, Any]], dict[str, Any]],
) -> Coupling | None:
    """Trace and compare copies of two of the params (see the module).

    Args:
        constructor: builds the inner optimizer (``optim`` of :class:`oss_plus.OSS`).
        defaults: its keyword arguments.
        param_groups: the global groups; the probe copies the shapes, dtypes and devices of
            the first two trainable params (at most
            :data:`~oss_plus.step.probe.runs.PROBE_DIM` per dimension) and their groups'
            hyperparameters.
        hyper: a group's hyperparameters (without its params).

    Returns:
        The :class:`Coupling` found (refused when :attr:`Coupling.coupled`), or None when
        there are fewer than two trainable params (nothing to read across).
    """
    return _probe(constructor, defaults, _chosen(param_groups, hyper))


def _probe(
    constructor: Callable[..., Optimizer],
    defaults: dict[str, Any],
    chosen: Sequence[ProbeParam],
) -> Coupling | None:
    """:func:`probe` on the params :func:`_chosen` picked."""
    if len(chosen) < 2:
        return None

    def build(groups: list[dict[str, Any]]) -> Optimizer:
        if _named.takes_named(constructor) is not None:  # the probe's params, named
            groups = [{**g, "param_names": [f"probe.{id(p)}" for p in g["params"]]} for g in groups]
        return _named.construct(constructor, groups, defaults)

    name = getattr(constructor, "__name__", type(constructor).__name__)
    try:
        return verdict(build, list(chosen), name)
    except NotBuilt as exc:
        copies = listed([m.name for m in chosen], [0, 1])
        why = f"its constructor refused the probe's copies of {copies} ({exc})"
        return Coupling(name, None, why)
    except Exception as exc:  # noqa: BLE001 - what cannot be shown is refused, with the reason
        return Coupling(name, None, f"the probe failed ({type(exc).__name__}: {exc})")


#: torch.optim's own classes, whose update of every param reads that param alone (their
#: foreach and fused kernels too): not probed, so building ``OSS`` over them costs nothing
#: more. Exact classes only: a subclass may read across params and is probed.
TORCH_PER_PARAM: frozenset[type] = frozenset(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "Adagrad",
        "Adadelta",
        "ASGD",
        "SparseAdam",
        "Adafactor",
        "Muon",
    )  # fmt: skip
    if hasattr(torch.optim, name)
)


def needs_probe(constructor: Any) -> bool:
    """Whether :func:`check` probes ``constructor``: anything but :data:`TORCH_PER_PARAM`
    (a ``functools.partial`` of one of those is unwrapped).

    Example:
        >>> needs_probe(torch.optim.AdamW), needs_probe(type("MyAdamW", (torch.optim.AdamW,), {}))
        (False, True)
    """
    return unwrap_partial(constructor) not in TORCH_PER_PARAM


#: Verdicts already reached, by constructor, hyperparameters and probe shapes (a construction
#: with the same optimizer and model probes once per process).
_verdicts: dict[tuple[Any, ...], Coupling | None] = {}
_MAX_VERDICTS = 256


def _key(constructor: Any, defaults: dict[str, Any], chosen: Sequence[Any]) -> tuple[Any, ...]:
    def plain(d: dict[str, Any]) -> str:
        return repr(sorted(d.items(), key=lambda kv: kv[0]))

    return (
        constructor,
        plain(defaults),
        tuple(
            (plain(m.options), tuple(m.like.shape), m.like.dtype, str(m.like.device))
            for m in chosen
        ),
    )


def check(
    constructor: Callable[..., Optimizer],
    defaults: dict[str, Any],
    param_groups: Sequence[dict[str, Any]],
    hyper: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """Raise ValueError (:data:`CROSS_PARAM`) if :func:`probe` finds the update of one param
    reading another; the verdict is kept per constructor, hyperparameters and probe shapes.

    Raises:
        ValueError: the optimizer's update of one param reads the others.
    """
    chosen = _chosen(param_groups, hyper)
    try:
        key: tuple[Any, ...] | None = _key(constructor, defaults, chosen)
        hash(key)
    except TypeError:  # an unhashable constructor: probe every time
        key = None
    if key is not None and key in _verdicts:
        found = _verdicts[key]
    else:
        found = _probe(constructor, defaults, chosen)
        if key is not None and len(_verdicts) < _MAX_VERDICTS:
            _verdicts[key] = found
    if found is not None and found.coupled:
        raise ValueError(found.message())


#: Raised for an ``allow_cross_param`` that is not a bool.
BAD_ALLOW = (
    "allow_cross_param must be False (refuse an optimizer whose update of one param reads the "
    "others) or True (shard it anyway), got {value!r}"
)


#: Raised for ``fsdp_in_use=True`` (prodigyopt, dadaptation) without ``allow_cross_param``.
FLAG_WITHOUT_ALLOW = (
    "{name} got fsdp_in_use=True, so its step all-reduces its sums over the default process "
    "group itself: pass allow_cross_param=True to OSS as well (docs/optimizers.md)"
)
#: Raised for ``fsdp_in_use=True`` where the shards are not spread over the default group.
FLAG_NOT_WORLD = (
    "{name} got fsdp_in_use=True, which all-reduces its sums over the default process group, "
    "but {where}: each sum would count {wrong}. Shard over the default group (group=None, no "
    "replicate_group) or leave fsdp_in_use False"
)


def refuse_cross_param(
    constructor: Callable[..., Optimizer], defaults: dict[str, Any], oss: Any
) -> None:
    """The check :class:`oss_plus.OSS` runs at construction, from its public attributes
    (``param_groups``, ``group``, ``allow_cross_param``, ``replicate_group``): nothing at
    world size 1 (nothing is sharded), with ``allow_cross_param`` True or for torch.optim's
    own classes (:func:`needs_probe`), else :func:`check` on the global groups. An optimizer
    told to reduce over the ranks itself (``fsdp_in_use=True``, prodigyopt's and
    dadaptation's flag) needs ``allow_cross_param`` and the default group (its all-reduce's).

    Raises:
        TypeError: ``allow_cross_param`` is not a bool.
        ValueError: the optimizer's update of one param reads the others, or ``fsdp_in_use``
            is set without ``allow_cross_param`` or over other ranks than the shards'.
    """
    allow, group, param_groups = oss.allow_cross_param, oss.group, oss.param_groups
    replicated = oss.replicate_group is not None
    if not isinstance(allow, bool):
        raise TypeError(BAD_ALLOW.format(value=allow))
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    name = getattr(constructor, "__name__", type(constructor).__name__)
    if defaults.get("fsdp_in_use") is True:
        if not allow:
            raise ValueError(FLAG_WITHOUT_ALLOW.format(name=name))
        if replicated or world_size != dist.get_world_size():
            where = (
                "the shards are replicated (hybrid sharding)"
                if replicated
                else f"the shards are spread over {world_size} of the {dist.get_world_size()} ranks"
            )
            wrong = "every replica's shard" if replicated else "the other ranks' params too"
            raise ValueError(FLAG_NOT_WORLD.format(name=name, where=where, wrong=wrong))
    if allow or not needs_probe(constructor):
        return
    check(constructor, defaults, param_groups, _hyper)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in NOT_HYPER}
