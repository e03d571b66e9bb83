"""Whether an optimizer's update of one param reads the others: a probe run once, on copies.

Sharding steps each param on its owner, with only the owner's params in the inner optimizer.
That is the unsharded algorithm exactly when the update of every param reads only that
param's gradient, state and hyperparameters. Optimizers that size their step from sums over
every param (Prodigy's and D-Adaptation's ``d``), or that normalise by a norm over all of them,
would run a different algorithm on each rank, silently. No list of class names can know every
such optimizer, so :func:`probe` asks the optimizer itself, with two witnesses
(:mod:`oss_plus.step.probe_runs` runs them):

1. **Where every value comes from** (:mod:`oss_plus.step.provenance`): the user's optimizer
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

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from oss_plus.state.index import NOT_HYPER
from oss_plus.step import params as _params
from oss_plus.step import probe_runs
from oss_plus.step.pieces import unwrap_partial
from oss_plus.step.probe_runs import (
    MODES,
    NotBuilt,
    NotStepped,
    ProbeParam,
    Schedule,
    traced,
    witness,
)
from oss_plus.step.provenance import Finding

__all__ = [
    "CROSS_PARAM",
    "Coupling",
    "TRACE_STEPS",
    "UNSHOWN",
    "WITNESS_STEPS",
    "check",
    "probe",
    "refuse_cross_param",
]

logger = logging.getLogger(__name__)

#: Steps of each traced run: warm-ups (a step-size estimate that starts moving late, a
#: coupling switched on at step 10), large gradients, small ones (:class:`Schedule`).
TRACE_STEPS = 12
#: Steps of the second traced run (the other order, large gradients first): the first run
#: already covered warm-ups.
SECOND_STEPS = 6
#: Steps of each run of the value witness.
WITNESS_STEPS = 6
#: How much larger than the others the middle third of the gradients is.
LARGE = 1e4

#: Raised, on every rank, for an optimizer whose update of one param reads the others.
CROSS_PARAM = (
    "{name} cannot be sharded as it is: its update of one param reads the other params "
    "({what}), so each rank stepping only its own shard would drift silently from the "
    "unsharded optimizer. If {name} can reduce its sums over the ranks itself (prodigyopt's and "
    "dadaptation's fsdp_in_use=True), turn that on and pass allow_cross_param=True to OSS "
    "(docs/optimizers.md); to accept the drift, pass allow_cross_param=True; else use {name} "
    "without oss_plus"
)
#: Raised, on every rank, for an optimizer the probe cannot show to be per param.
UNSHOWN = (
    "oss_plus cannot show that {name} updates each param from that param alone: {why}. "
    "Sharded, it might drift silently from the unsharded optimizer, so it is refused. To "
    "shard it anyway, pass allow_cross_param=True to OSS (docs/optimizers.md); else use "
    "{name} without oss_plus"
)
#: What differed, for an optimizer whose step draws random numbers (stochastic rounding).
RANDOM = (
    "its step draws random numbers, and which numbers a param gets depends on the params "
    "stepped before it"
)


@dataclasses.dataclass(frozen=True)
class Coupling:
    """What the probe found.

    Attributes:
        name: the optimizer's class name.
        difference: what read across params, in words (None: shown per param, or unshown).
        unshown: why per param could not be shown (None: it was, or a coupling was found).
    """

    name: str
    difference: str | None
    unshown: str | None = None

    @property
    def coupled(self) -> bool:
        """Whether the optimizer is refused: its update of one param read another, or
        that it does not could not be shown."""
        return self.difference is not None or self.unshown is not None

    def message(self) -> str:
        """The :data:`CROSS_PARAM` or :data:`UNSHOWN` message."""
        if self.difference is not None:
            return CROSS_PARAM.format(name=self.name, what=self.difference)
        return UNSHOWN.format(name=self.name, why=self.unshown)


def _names(names: Sequence[str], which: Sequence[int]) -> str:
    said = [names[i] for i in which]
    return " and ".join([", ".join(said[:-1]), said[-1]] if len(said) > 2 else said)


def describe(finding: Finding, names: Sequence[str]) -> str:
    """A :class:`~oss_plus.step.provenance.Finding` in words (the params by ``names``)."""
    at = f"at probe step {finding.step}"
    who = _names(names, finding.origins)
    meet = f"; they first meet in {finding.via}" if finding.via else ""
    if finding.kind == "random":
        return f"{RANDOM}: the draws of {finding.where} reach {who}, {at}"
    if finding.kind == "host":
        return (
            f"a value computed from {who} is read on the host by {finding.where} ({at}{meet}): "
            "each rank would read it from its own shard"
        )
    return f"{finding.where} is computed from {who} ({at}{meet})"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))
    return torch.equal(a, b)


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    for key in sorted(k for k in a if k != "params" and k in b):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            continue
        try:
            same = bool(x == y)
        except (TypeError, ValueError, RuntimeError):
            continue
        if not same:
            return (
                f"its param group's {key!r} became {x!r} with another param present, {y!r} without"
            )
    return None


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
            :data:`~oss_plus.step.probe_runs.PROBE_DIM` per dimension) and their groups'
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
        if _params.takes_named(constructor) is not None:  # the probe's params, named
            groups = [{**g, "param_names": [f"probe.{id(p)}" for p in g["params"]]} for g in groups]
        return _params.construct(constructor, groups, defaults)

    name = getattr(constructor, "__name__", type(constructor).__name__)
    try:
        return _verdict(build, list(chosen), name)
    except NotBuilt as exc:
        copies = _names([m.name for m in chosen], [0, 1])
        why = f"its constructor refused the probe's copies of {copies} ({exc})"
        return Coupling(name, None, why)
    except Exception as exc:  # noqa: BLE001 - what cannot be shown is refused, with the reason
        return Coupling(name, None, f"the probe failed ({type(exc).__name__}: {exc})")


#: How each mode's run is said when it raised.
_MODE_WORDS = {
    "plain": "gradients set before it",
    "closure": "a closure",
    "graph": "gradients that carry their graph",
}


def _traced_mode(
    build: Callable[[list[dict[str, Any]]], Optimizer], chosen: list[ProbeParam]
) -> tuple[str, list[Finding], str] | str:
    """The first run that steps (:data:`~oss_plus.step.probe_runs.MODES` in order): its mode,
    findings and class name; or why none stepped."""
    failed = []
    for mode in (m for m in MODES if m == "plain" or m in probe_runs.CHANNELS):
        try:
            findings, cls = traced(build, chosen, Schedule.of(TRACE_STEPS, LARGE), mode, True)
        except NotStepped as exc:
            failed.append(f"{_MODE_WORDS[mode]} ({exc})")
            continue
        return mode, findings, cls
    return "its step raised on the probe's tensors, with " + "; with ".join(failed)


def _verdict(
    build: Callable[[list[dict[str, Any]]], Optimizer], chosen: list[ProbeParam], name: str
) -> Coupling:
    names = [m.name for m in chosen]
    first = _traced_mode(build, chosen)
    if isinstance(first, str):
        return Coupling(name, None, first)
    mode, findings, name = first
    if not findings:  # the other order, each in its own group, from the large gradients on,
        # with a closure where the step takes one (a training loop may pass one)
        swapped = [chosen[1], chosen[0]]
        names = [names[1], names[0]]
        large = Schedule((LARGE,) * (SECOND_STEPS // 2) + (1.0,) * (SECOND_STEPS // 2))
        second = "closure" if mode == "plain" and "closure" in probe_runs.CHANNELS else mode
        try:
            findings, _ = traced(build, swapped, large, second, False)
        except NotStepped:  # a step that cannot take a closure never gets one
            findings, _ = traced(build, swapped, large, mode, False)
    if findings:
        return Coupling(name, describe(findings[0], names))
    if "witness" not in probe_runs.CHANNELS:
        return Coupling(name, None)
    return Coupling(name, _witness(build, chosen, mode))


def _witness(
    build: Callable[[list[dict[str, Any]]], Optimizer], chosen: list[ProbeParam], mode: str
) -> str | None:
    """The value witness: each param stepped with the other present and alone, compared
    bit for bit; what differed, or None."""
    schedule = Schedule.of(WITNESS_STEPS, LARGE)
    for first, second in ((chosen[0], chosen[1]), (chosen[1], chosen[0])):
        together, group_together = witness(build, [first, second], schedule, mode)
        alone, group_alone = witness(build, [first], schedule, mode)
        what = _first_difference(group_together, group_alone)
        if not _same_bits(together, alone):
            if not _same_bits(alone, witness(build, [first], schedule, mode, seed=1)[0]):
                return RANDOM
            gap = (together.double() - alone.double()).abs().max().item()
            where = (
                f"{first.name}'s update changed by up to {gap:.3g} with {second.name} present "
                "(the values alone: the trace did not follow how)"
            )
            return f"{where}; {what}" if what else where
        if what is not None:
            return what
    return None


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
