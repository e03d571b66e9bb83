"""Whether an optimizer's update of one param reads the others: a probe run once, on copies.

Sharding steps each param on its owner, with only the owner's params in the inner optimizer.
That is the unsharded algorithm exactly when the update of every param reads only that
param's gradient, state and hyperparameters. Optimizers that size their step from sums over
every param (Prodigy's and D-Adaptation's ``d``), or that normalise by a norm over all of them,
would run a different algorithm on each rank, silently. No list of class names can know every
such optimizer, so :func:`probe` asks the optimizer itself: it builds the user's optimizer
(the same constructor and hyperparameters) over two small copies of the model's params, and
again over each copy alone, steps each a few times on the same gradients, and compares the
copies bit for bit. A per-param optimizer gives the same values with the other param present
or not; an optimizer that reads across params does not.

The probe runs at construction, before any param changes, on tensors the user never sees;
it draws no number from the global random generators that the training sees (they are
forked and reseeded alike for every run, so an optimizer that draws random numbers per param
compares equal), and a step therefore costs nothing: :func:`oss_plus.OSS.step` is unchanged.
Its cost is measured in ``docs/optimizers.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from oss_plus.state.index import NOT_HYPER
from oss_plus.step.pieces import unwrap_partial

__all__ = ["CROSS_PARAM", "Coupling", "PROBE_STEPS", "check", "probe", "refuse_cross_param"]

logger = logging.getLogger(__name__)

#: Steps of each probe run: D-Adaptation's and Prodigy's group values differ from the second
#: step on (their first numerators are zero), their params from the third.
PROBE_STEPS = 3
#: The largest size of a probe tensor along each dimension (shapes keep the params' ndim).
PROBE_DIM = 6

#: Raised, on every rank, for an optimizer whose update of one param reads the others.
CROSS_PARAM = (
    "{name} cannot be sharded as it is: its update of one param reads the other params "
    "({what}), so each rank stepping only its own shard would drift silently from the "
    "unsharded optimizer. If {name} can reduce its sums over the ranks itself (prodigyopt's and "
    "dadaptation's fsdp_in_use=True), turn that on and pass allow_cross_param=True to OSS "
    "(docs/optimizers.md); to accept the drift, pass allow_cross_param=True; else use {name} "
    "without oss_plus"
)
#: What differed, for an optimizer whose step draws random numbers (stochastic rounding).
RANDOM = (
    "its step draws random numbers, and which numbers a param gets depends on the params "
    "stepped before it"
)
#: Logged (once per class) when the probe could not step the optimizer.
PROBE_FAILED = (
    "oss_plus could not check whether %s reads across params (its step on probe tensors "
    "raised %s: %s); if its update of one param reads the others, sharding it is not exact. "
    "allow_cross_param=True skips this check"
)

_warned: set[str] = set()


class _NotBuilt(Exception):
    """The optimizer's constructor refused the probe's params."""


@dataclasses.dataclass(frozen=True)
class Coupling:
    """What the probe found: the first difference, or None when the runs agreed.

    Attributes:
        name: the optimizer's class name.
        difference: what differed, in words (None: per param, as far as the probe sees).
    """

    name: str
    difference: str | None

    @property
    def coupled(self) -> bool:
        """Whether the update of one param read another."""
        return self.difference is not None

    def message(self) -> str:
        """The :data:`CROSS_PARAM` message."""
        return CROSS_PARAM.format(name=self.name, what=self.difference)


def _probe_tensor(like: torch.Tensor, seed: int) -> torch.Tensor:
    shape = tuple(min(d, PROBE_DIM) for d in like.shape)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    return values.to(device=like.device, dtype=like.dtype)


def _grads(like: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """A gradient of one direction with a little noise per step: the params then move
    steadily, so the step-size estimates of Prodigy and D-Adaptation grow from the second
    step on (their numerators sum ``grad . (p0 - p)``, which random directions cancel)."""
    base = _probe_tensor(like, seed * 1000)
    return [base + 0.1 * _probe_tensor(like, seed * 1000 + s) for s in range(1, PROBE_STEPS + 1)]


def _run(
    build: Callable[[list[dict[str, Any]]], Optimizer],
    groups: Sequence[tuple[dict[str, Any], torch.Tensor, list[torch.Tensor]]],
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, Any], str]:
    """Step an optimizer over ``groups`` (options, initial value, grads); return the first
    param's value and its group's options after the steps, and the optimizer's class name."""
    params = [torch.nn.Parameter(init.clone()) for _, init, _ in groups]
    # the training's generators untouched; eager (heavyball and torchao compile their steps:
    # the question is the same either way, and compiling for the probe's shapes costs seconds)
    with torch.random.fork_rng(devices=_devices(params)), _eager():
        torch.manual_seed(seed)
        try:
            opt = build([{**options, "params": [p]} for (options, _, _), p in zip(groups, params)])
        except Exception as exc:  # noqa: BLE001 - the real construction reports it
            raise _NotBuilt from exc
        opt.oss_plus_probe = True  # type: ignore[attr-defined]  # what counts instances can tell
        train = getattr(opt, "train", None)
        if callable(train):  # schedule-free optimizers step in train mode only
            train()
        for s in range(PROBE_STEPS):
            for p, (_, _, grads) in zip(params, groups):
                p.grad = grads[s].clone()
            opt.step()
    return params[0].detach().clone(), dict(opt.param_groups[0]), type(opt).__name__


def _eager() -> Any:
    """``torch.compile``'d functions run eagerly inside (``torch.compiler.set_stance``, public
    since torch 2.6)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _devices(params: Sequence[torch.Tensor]) -> list[Any]:
    return sorted({p.device for p in params if p.device.type == "cuda"}, key=str)


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
) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """The first two trainable params, each with its group's hyperparameters."""
    found = []
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad:
                found.append((hyper(group), p))
                if len(found) == 2:
                    return found
    return found


def probe(
    constructor: Callable[..., Optimizer],
    defaults: dict[str, Any],
    param_groups: Sequence[dict[str, Any]],
    hyper: Callable[[dict[str, Any]], dict[str, Any]],
) -> Coupling | None:
    """Step copies of two of the params with and without each other; compare bit for bit.

    Args:
        constructor: builds the inner optimizer (``optim`` of :class:`oss_plus.OSS`).
        defaults: its keyword arguments.
        param_groups: the global groups; the probe copies the shapes, dtypes and devices of
            the first two trainable params (shrunk to :data:`PROBE_DIM` per dimension) and
            their groups' hyperparameters.
        hyper: a group's hyperparameters (without its params).

    Returns:
        The :class:`Coupling` found, or None when there are fewer than two trainable params or
        the optimizer's step failed on the probe (logged once per class).
    """
    return _probe(constructor, defaults, _chosen(param_groups, hyper))


def _probe(
    constructor: Callable[..., Optimizer],
    defaults: dict[str, Any],
    chosen: Sequence[tuple[dict[str, Any], torch.Tensor]],
) -> Coupling | None:
    """:func:`probe` on the params :func:`_chosen` picked."""
    if len(chosen) < 2:
        return None
    runs = [
        (options, _probe_tensor(p, 2 * i + 1), _grads(p, 2 * i + 2))
        for i, (options, p) in enumerate(chosen)
    ]

    def build(groups: list[dict[str, Any]]) -> Optimizer:
        return constructor(groups, **defaults)

    name = getattr(constructor, "__name__", type(constructor).__name__)
    try:
        for first, second in ((runs[0], runs[1]), (runs[1], runs[0])):
            together, group_together, name = _run(build, [first, second])
            alone, group_alone, _ = _run(build, [first])
            what = _first_difference(group_together, group_alone)
            if not torch.equal(together, alone):
                if not torch.equal(alone, _run(build, [first], seed=1)[0]):
                    return Coupling(name, RANDOM)
                gap = (together.double() - alone.double()).abs().max().item()
                where = f"a param's update changed by up to {gap:.3g} with another param present"
                return Coupling(name, f"{where}; {what}" if what else where)
            if what is not None:
                return Coupling(name, what)
    except _NotBuilt:  # the optimizer refuses these params (Muon and a bias): the real
        return None  # construction raises that, on every rank
    except Exception as exc:  # noqa: BLE001 - a failing probe must not refuse the optimizer
        if name not in _warned:
            _warned.add(name)
            logger.warning(PROBE_FAILED, name, type(exc).__name__, exc)
        return None
    return Coupling(name, None)


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
        tuple((plain(h), tuple(p.shape), p.dtype, str(p.device)) for h, p in chosen),
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
