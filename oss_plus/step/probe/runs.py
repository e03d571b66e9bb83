"""The runs of the cross-param probe: an optimizer stepped over small copies of two params.

:mod:`oss_plus.step.coupling` decides; this module steps. A run builds the user's optimizer
(the same constructor and hyperparameters) over probe tensors shaped like the model's first
two trainable params (at most :data:`PROBE_DIM` along each dimension), and steps it on
gradients it makes itself, in one of two ways (:data:`MODES`):

* ``"plain"``: each param's gradient is set before the step;
* ``"closure"``: the same, and a step that takes an argument gets a closure (the loss of the
  probe's own tensors, whose backward sets the same gradients), as a training loop that
  passes one would;
* ``"graph"``: the gradients carry their graph (``backward(create_graph=True)``), for a step
  that differentiates them (a Hessian-vector product); the loss then holds a term of value 0
  whose second derivative joins the two params, as any model's loss does.

A run is either *traced* (:class:`oss_plus.step.probe.trace.Tracer`: where every value came
from) or a *witness* (values only, compared by the caller with and without the other param).
Every run forks the training's random generators and reseeds them, and runs
``torch.compile``'d code eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from oss_plus.step.probe.numbers import origins_of_value, params_in
from oss_plus.step.probe.trace import Finding, Tracer

__all__ = [
    "CHANNELS",
    "MODES",
    "PROBE_DIM",
    "ProbeParam",
    "Schedule",
    "NotBuilt",
    "traced",
    "witness",
]

#: The largest size of a probe tensor along each dimension (shapes keep the params' ndim).
PROBE_DIM = 6
#: How the gradients reach the step, tried in this order.
MODES = ("plain", "closure", "graph")
#: What the probe looks at (tests remove one at a time to show that each is needed): where a
#: traced value must not come from other params (``"param"``, ``"state"``, ``"group"``),
#: host reads (``"host"``), random draws (``"random"``), the runs with a closure and with
#: gradients that carry their graph (``"closure"``, ``"graph"``), the value witness
#: (``"witness"``).
CHANNELS = frozenset({"param", "state", "group", "host", "random", "closure", "graph", "witness"})


class NotBuilt(Exception):
    """The optimizer's constructor refused the probe's params."""


class NotStepped(Exception):
    """The optimizer's step raised on the probe's tensors."""


@dataclasses.dataclass(frozen=True)
class ProbeParam:
    """One of the model's params as the probe copies it.

    Attributes:
        options: its group's hyperparameters.
        like: the model's param (its dtype, device, ndim; its values are never read).
        name: how messages name it.
        seed: where its probe values and gradients come from.
    """

    options: dict[str, Any]
    like: torch.Tensor
    name: str
    seed: int

    def initial(self) -> torch.Tensor:
        return _probe_tensor(self.like, self.seed)

    def grad(self, step: int, scale: float) -> torch.Tensor:
        """A gradient of one direction with a little noise per step: the params then move
        steadily, so the step-size estimates of Prodigy and D-Adaptation grow (their
        numerators sum ``grad . (p0 - p)``, which random directions cancel)."""
        base = _probe_tensor(self.like, self.seed * 1000)
        noise = _probe_tensor(self.like, self.seed * 1000 + step + 1)
        return (base + 0.1 * noise) * scale


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The gradient scale of every step of a run (its length is the number of steps)."""

    scales: tuple[float, ...]

    @classmethod
    def of(cls, steps: int, large: float = 1e4) -> Schedule:
        """Warm-up steps at scale 1, then a third of large gradients (past clipping
        thresholds), then small ones."""
        third = max(1, steps // 3)
        rest = steps - 2 * third
        return cls((1.0,) * third + (large,) * third + (1.0 / large,) * rest)


def _probe_tensor(like: torch.Tensor, seed: int) -> torch.Tensor:
    shape = tuple(min(d, PROBE_DIM) for d in like.shape)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    return values.to(device=like.device, dtype=like.dtype)


def _eager() -> Any:
    """``torch.compile``'d functions run eagerly inside (``torch.compiler.set_stance``)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _isolated(params: Sequence[torch.Tensor], seed: int) -> Iterator[None]:
    devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices), _eager():
        torch.manual_seed(seed)
        yield


def _build(
    build: Callable[[list[dict[str, Any]]], Optimizer],
    members: Sequence[ProbeParam],
    params: Sequence[torch.Tensor],
    grouped: bool,
) -> Optimizer:
    if grouped:  # one group: a value summed over a group's params is seen too
        groups = [{**members[0].options, "params": list(params)}]
    else:
        groups = [{**m.options, "params": [p]} for m, p in zip(members, params)]
    try:
        opt = build(groups)
    except Exception as exc:  # noqa: BLE001 - the caller names it
        raise NotBuilt(f"{type(exc).__name__}: {exc}") from exc
    opt.oss_plus_probe = True  # type: ignore[attr-defined]  # what counts instances can tell
    train = getattr(opt, "train", None)
    if callable(train):  # schedule-free optimizers step in train mode only
        train()
    return opt


def _takes_closure(opt: Optimizer) -> bool:
    try:
        return bool(inspect.signature(opt.step).parameters)
    except (TypeError, ValueError):
        return True


class _Grads:
    """Sets the gradients of one step, as :data:`MODES` says, and labels them for a tracer."""

    def __init__(
        self, members: Sequence[ProbeParam], params: Sequence[torch.Tensor], mode: str, tracer: Any
    ) -> None:
        self.members, self.params, self.mode, self.tracer = members, params, mode, tracer

    def loss(self, step: int, scale: float) -> torch.Tensor:
        with torch.enable_grad():
            parts = [(p * m.grad(step, scale)).sum() for m, p in zip(self.members, self.params)]
            loss = torch.stack(parts).sum()
            if self.mode == "graph" and len(self.params) > 1:  # value 0, second derivative not
                zero = [((p - p.detach()) * p.detach()).sum() for p in self.params]
                loss = loss + torch.stack(zero).prod()
        return loss

    def set(self, step: int, scale: float) -> torch.Tensor | None:
        """Set every param's gradient; return the loss (None but in graph mode)."""
        if self.mode != "graph":
            with self._paused():
                for m, p in zip(self.members, self.params):
                    p.grad = m.grad(step, scale)
                self._label()
            return None
        for p in self.params:
            p.grad = None
        loss = self.loss(step, scale)
        with torch.enable_grad():
            loss.backward(create_graph=True)
        self._label()
        return loss

    def closure(self, step: int, scale: float) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            loss = self.set(step, scale) if self.mode == "graph" else None
            if loss is None:  # the gradients are set(), as a backward of this loss would
                loss = self.loss(step, scale)
                with self._paused():
                    for m, p in zip(self.members, self.params):  # the same values as set()
                        p.grad = m.grad(step, scale)
                    self._label()
            with self._paused():
                if self.tracer is not None:
                    everyone = range(len(self.params))
                    self.tracer.label(loss, everyone, via="the closure's loss")
                return loss.detach()

        return closure

    def _paused(self) -> Any:
        return self.tracer.paused() if self.tracer is not None else contextlib.nullcontext()

    def _label(self) -> None:
        if self.tracer is None:
            return
        with self.tracer.paused():
            for i, p in enumerate(self.params):  # a param's gradient is that param's input
                self.tracer.label(p.grad, {i})


def _step(opt: Optimizer, grads: _Grads, step: int, scale: float) -> None:
    grads.set(step, scale)
    try:
        if grads.mode != "plain" and _takes_closure(opt):
            opt.step(grads.closure(step, scale))  # type: ignore[arg-type]
        else:
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the caller tries the next mode, or names it
        raise NotStepped(f"{type(exc).__name__}: {exc}") from exc


def traced(
    build: Callable[[list[dict[str, Any]]], Optimizer],
    members: Sequence[ProbeParam],
    schedule: Schedule,
    mode: str,
    grouped: bool,
) -> tuple[list[Finding], str]:
    """Step the optimizer over ``members`` under a :class:`Tracer`; return what reached where
    it must not (in step order) and the optimizer's class name.

    Raises:
        NotBuilt: the constructor refused the probe's params.
        NotStepped: a step raised.
    """
    params = [torch.nn.Parameter(m.initial()) for m in members]
    with _isolated(params, 0):
        opt = _build(build, members, params, grouped)
        tracer = Tracer(host="host" in CHANNELS)
        for i, p in enumerate(params):
            tracer.label(p, {i})
        grads = _Grads(members, params, mode, tracer)
        reached: dict[str, set[int]] = {}
        with tracer:
            for s, scale in enumerate(schedule.scales):
                tracer.step = s + 1
                _step(opt, grads, s, scale)
                with tracer.paused():  # the inspection's own ops are not traced
                    names = [m.name for m in members]
                    tracer.findings += _inspect(opt, params, tracer, reached, names)
                if tracer.findings:
                    break
    return tracer.findings, type(opt).__name__


def witness(
    build: Callable[[list[dict[str, Any]]], Optimizer],
    members: Sequence[ProbeParam],
    schedule: Schedule,
    mode: str,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Step the optimizer over ``members`` (values only); return the first param's value
    and its group's options after the steps."""
    params = [torch.nn.Parameter(m.initial()) for m in members]
    with _isolated(params, seed):
        opt = _build(build, members, params, grouped=False)
        grads = _Grads(members, params, mode, None)
        for s, scale in enumerate(schedule.scales):
            _step(opt, grads, s, scale)
    return params[0].detach().clone(), dict(opt.param_groups[0])


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


def _origins(tracer: Tracer, value: Any) -> frozenset[Any]:
    if isinstance(value, torch.Tensor):
        return tracer.origins(value)
    return origins_of_value(value)


def _inspect(
    opt: Optimizer,
    params: Sequence[torch.Tensor],
    tracer: Tracer,
    reached: dict[str, set[int]],
    names: Sequence[str],
) -> list[Finding]:
    """After a step: does a param, its state, a group value or state kept for no param hold
    a value from params it must not read? (``reached``: the params each random generator's
    draws reached so far.)"""
    index = {id(p): i for i, p in enumerate(params)}
    found: list[Finding] = []

    def check(where: str, value: Any, allowed: set[int], owner: int | None) -> None:
        """``allowed``: the params ``value`` may come from; a value of no param (``owner``
        None: a group's, or state kept for no param) may come from one of them only."""
        origins = _origins(tracer, value)
        if owner is not None:
            for token in (o for o in origins if isinstance(o, str)):
                reached.setdefault(token, set()).add(owner)
        mixed = params_in(origins)
        if set(mixed) - allowed or (owner is None and len(mixed) > 1):
            via = tracer.via(value) if isinstance(value, torch.Tensor) else "a Python number"
            found.append(Finding("value", where, tuple(mixed), via or "?", tracer.step))

    for i, p in enumerate(params):
        if "param" in CHANNELS:
            check(f"the value of {names[i]}", p, {i}, i)
    for holder, state in opt.state.items():
        owner = index.get(id(holder))
        for path, value in _walk(state) if "state" in CHANNELS else ():
            if owner is None:  # state kept for no param
                check(f"its state {path}", value, set(range(len(params))), None)
            else:
                check(f"the state {path} of {names[owner]}", value, {owner}, owner)
    for group in opt.param_groups if "group" in CHANNELS else ():
        members = {index[id(p)] for p in group["params"] if id(p) in index}
        for name, value in group.items():
            if name != "params":
                for path, v in _walk(value, repr(name)):
                    check(f"the param-group value {path}", v, members, None)
    for token, who in reached.items():
        if len(who) > 1 and "random" in CHANNELS:
            found.append(Finding("random", token[4:], tuple(sorted(who)), "", tracer.step))
    return found
