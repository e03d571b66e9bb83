"""The probe's verdict on an optimizer: the traced runs, then the value witness
(:mod:`oss_plus.step.coupling` says what the probe is; this module runs its witnesses over the
copies :mod:`oss_plus.step.probe.runs` steps, and puts what they found in words)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from oss_plus.step.probe import runs as probe_runs
from oss_plus.step.probe.runs import MODES, NotStepped, ProbeParam, Schedule, traced, witness
from oss_plus.step.probe.trace import Finding

__all__ = [
    "CROSS_PARAM",
    "Coupling",
    "LARGE",
    "RANDOM",
    "SECOND_STEPS",
    "TRACE_STEPS",
    "UNSHOWN",
    "WITNESS_STEPS",
    "describe",
    "listed",
    "verdict",
]

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


def listed(names: Sequence[str], which: Sequence[int]) -> str:
    said = [names[i] for i in which]
    return " and ".join([", ".join(said[:-1]), said[-1]] if len(said) > 2 else said)


def describe(finding: Finding, names: Sequence[str]) -> str:
    """A :class:`~oss_plus.step.probe.trace.Finding` in words (the params by ``names``)."""
    at = f"at probe step {finding.step}"
    who = listed(names, finding.origins)
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


#: How each mode's run is said when it raised.
_MODE_WORDS = {
    "plain": "gradients set before it",
    "closure": "a closure",
    "graph": "gradients that carry their graph",
}


def _traced_mode(
    build: Callable[[list[dict[str, Any]]], Optimizer], chosen: list[ProbeParam]
) -> tuple[str, list[Finding], str] | str:
    """The first run that steps (:data:`~oss_plus.step.probe.runs.MODES` in order): its mode,
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


def verdict(
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
