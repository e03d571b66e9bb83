"""Validation and normalisation of what users pass as ``params`` and ``optim``."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from oss_plus.planning.partition import ParamSpec, Rule
from oss_plus.planning.plan import ShardPlan
from oss_plus.planning.policy import Layout, ShardPolicy
from oss_plus.runtime import dist as _dist
from oss_plus.step import named as _named
from oss_plus.step.pieces import is_elementwise, not_elementwise_message
from oss_plus.wire.layout import alignment

#: Raised on every rank by a repartition when the ranks hold different shard plans.
PLANS_DIFFER = (
    "the ranks hold different shard plans (global ranks with equal plans: {ranks}), so their "
    "state and buckets would not match: every rank must repartition with the same plan. A "
    "requires_grad change made on some ranks only gives different plans: freeze or unfreeze "
    "the same params on every rank"
)

EMPTY_PARAMS = "oss_plus.OSS got an empty parameter list: pass model.parameters() or param groups"

#: Optimizers whose update is not per parameter: one update direction over all their params
#: (and state kept for the whole set), so sharding them changes the algorithm.
NOT_PER_PARAM_CLASSES: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)
#: Raised for an optimizer of :data:`NOT_PER_PARAM_CLASSES` (or a subclass).
NOT_PER_PARAM = (
    "{name} cannot be sharded: it computes one update over all its params together ({base} "
    "keeps a single history for the whole set), so each rank stepping only its own params "
    "would run a different algorithm. oss_plus shards per-parameter optimizers only (SGD, "
    "Adam, AdamW, Adagrad, ...): use {name} without oss_plus, on every rank"
)
#: Raised for a keyword the optimizer's constructor does not take.
UNKNOWN_KEYWORD = (
    "{name} got an unexpected keyword argument {key!r} (it takes {accepted}): remove it or "
    "fix its spelling"
)
#: Raised for a keyword the constructor does not take and fixes to another value.
FIXED_KEYWORD = (
    "{name} does not take the keyword argument {key!r}: it always uses {key}={fixed!r}, but "
    "{value!r} was given. Drop the keyword, or use a class that takes it"
)


def check_optim_class(optim: Any) -> None:
    """Raise TypeError unless ``optim`` builds a ``torch.optim.Optimizer``."""
    if isinstance(optim, Optimizer):
        raise TypeError(
            f"optim must be an optimizer class such as torch.optim.Adam, got an instance of "
            f"{type(optim).__name__}: pass the class and its arguments, "
            f"OSS(params, optim={type(optim).__name__}, lr=...)"
        )
    if isinstance(optim, type):
        if not issubclass(optim, Optimizer):
            raise TypeError(
                f"optim must be a subclass of torch.optim.Optimizer, got class {optim.__name__}"
            )
    elif not callable(optim):
        raise TypeError(f"optim must be an optimizer class such as torch.optim.Adam, got {optim!r}")
    if isinstance(optim, type):
        check_per_param(optim)


def check_per_param(optimizer: Any) -> None:
    """Raise ValueError if ``optimizer`` (a class or an instance) is not per parameter."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for base in NOT_PER_PARAM_CLASSES:
        if issubclass(cls, base):
            raise ValueError(NOT_PER_PARAM.format(name=cls.__name__, base=base.__name__))


def split_defaults(optim: Any, defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``defaults`` into the keywords ``optim``'s constructor takes and the others.

    Everything is taken when the signature cannot be read or has ``**kwargs``.

    Example:
        >>> split_defaults(torch.optim.AdamW, {"lr": 0.1, "decoupled_weight_decay": True})
        ({'lr': 0.1}, {'decoupled_weight_decay': True})
    """
    try:
        parameters = inspect.signature(optim).parameters.values()
    except (TypeError, ValueError):
        return dict(defaults), {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(defaults), {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in parameters if p.kind in named}
    taken = {k: v for k, v in defaults.items() if k in names}
    return taken, {k: v for k, v in defaults.items() if k not in names}


def check_fixed_defaults(inner: Optimizer, others: dict[str, Any]) -> None:
    """Accept keywords the constructor did not take only if ``inner`` fixes them to the same
    value (``torch.optim.AdamW``'s ``decoupled_weight_decay=True``); raise TypeError else.

    ``others`` comes from :func:`split_defaults`; the value ``inner`` uses is read from its
    ``defaults`` (what ``type(opt)(params, **opt.defaults)`` round trips pass back).
    """
    name = type(inner).__name__
    for key, value in others.items():
        if key not in inner.defaults:
            accepted = sorted(k for k in inspect.signature(type(inner)).parameters if k != "params")
            raise TypeError(UNKNOWN_KEYWORD.format(name=name, key=key, accepted=accepted))
        fixed = inner.defaults[key]
        if not _same_value(fixed, value):
            raise TypeError(FIXED_KEYWORD.format(name=name, key=key, fixed=fixed, value=value))


def _same_value(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # e.g. tensors of several elements
        return False


def build_inner(
    constructor: Callable[..., Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> Optimizer:
    """Build the inner optimizer over one rank's groups and check what it built: a
    ``torch.optim.Optimizer``, or an object that wraps one the way schedulefree's
    ``ScheduleFreeWrapper`` does (it has every member of :data:`OPTIMIZER_LIKE`, its
    ``param_groups`` and ``state`` being the wrapped optimizer's).

    Raises:
        TypeError: ``constructor`` built neither.
        ValueError: it is not a per-parameter optimizer (see :func:`check_per_param`).
    """
    inner = _named.construct(constructor, groups, defaults)
    if _named.takes_named(constructor) is not None:
        _named.check_kept_groups(constructor, inner, groups)
    if not isinstance(inner, Optimizer):
        missing = [name for name in OPTIMIZER_LIKE if not hasattr(inner, name)]
        if missing:
            raise TypeError(NOT_AN_OPTIMIZER.format(name=type(inner).__name__, missing=missing))
    check_per_param(inner)
    return inner


#: OSS's construction calls it through this module.
check_named = _named.check_named

#: What an inner optimizer that is not a ``torch.optim.Optimizer`` must have (a wrapper of
#: one, as schedulefree's ``ScheduleFreeWrapper``).
OPTIMIZER_LIKE = ("step", "param_groups", "state", "state_dict", "load_state_dict")
#: TypeError when ``optim`` built something else.
NOT_AN_OPTIMIZER = (
    "optim built a {name}, which is not a torch.optim.Optimizer and lacks {missing} of a "
    "wrapper of one: build a torch.optim.Optimizer (or an object wrapping one, with step, "
    "param_groups, state, state_dict and load_state_dict)"
)


#: Raised for an ``auto_refresh`` that is not a bool.
BAD_AUTO_REFRESH = (
    "auto_refresh must be True (check requires_grad and re-allocation at every step) or "
    "False (call refresh_trainable() / install_sync() yourself), got {value!r}"
)


def check_options(
    optim: Any,
    broadcast_dtype: Any,
    shard_policy: Any,
    partition_rule: Any,
    auto_refresh: Any = True,
) -> ShardPolicy:
    """Validate the options of :class:`oss_plus.OSS`; return the effective policy.

    Raises:
        TypeError: ``optim`` is not an optimizer class, ``shard_policy`` not a policy, or
            ``auto_refresh`` not a bool.
        ValueError: a wire dtype other than fp16/bf16, or an unknown partition rule.
    """
    check_optim_class(optim)
    if not isinstance(auto_refresh, bool):
        raise TypeError(BAD_AUTO_REFRESH.format(value=auto_refresh))
    if broadcast_dtype is not None and broadcast_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"broadcast_dtype must be torch.float16, torch.bfloat16 or None, got {broadcast_dtype}"
        )
    if shard_policy is not None and not isinstance(shard_policy, ShardPolicy):
        raise TypeError(
            f"shard_policy must be an oss_plus.planning.plan.ShardPolicy, got {shard_policy!r}"
        )
    policy = shard_policy or ShardPolicy()
    if partition_rule is not None:
        policy = dataclasses.replace(policy, rule=Rule(partition_rule))
    if policy.rule is Rule.FLAT:
        if not is_elementwise(optim):
            raise ValueError(not_elementwise_message(optim))
        if policy.layout is not Layout.OWNER_BUCKETS:
            raise ValueError(
                f"partition_rule='flat' lays params out in its own buffers: it needs "
                f"layout='owner_buckets', got layout={policy.layout.value!r}"
            )
    return policy


def new_group(param_group: dict[str, Any], known: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Normalize a group for ``add_param_group``; its params must be new.

    Raises:
        ValueError: a param of the group is already in ``known`` (another group).
    """
    (normalized,) = normalize_params([param_group])
    ids = {id(p) for p in known}
    clash = [i for i, p in enumerate(normalized["params"]) if id(p) in ids]
    if clash:
        raise ValueError(
            f"param {clash[0]} of the new group is already in another param group: "
            "every param may belong to one group only"
        )
    return normalized


def normalize_params(params: Any) -> list[dict[str, Any]]:
    """Return ``params`` as a list of param-group dicts, validated.

    Accepts an iterable (list, generator) of tensors, of ``(name, tensor)`` pairs (as from
    ``named_parameters()``), or of group dicts whose ``params`` are any of those. Group dicts
    are kept, not copied (their ``params`` become lists), as ``torch.optim.Optimizer`` keeps
    them: a scheduler built on another optimizer over the same dicts drives this one.

    Raises:
        TypeError: ``params`` is a single tensor, not iterable, or holds a non-tensor.
        ValueError: empty, a sparse param, or a param listed twice.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or param groups, got a single tensor: "
            "wrap it in a list, OSS([tensor], ...)"
        )
    if isinstance(params, dict):
        params = [params]
    try:
        items = list(params)
    except TypeError as exc:
        raise TypeError(
            f"params must be an iterable of tensors or param groups, got {type(params).__name__}"
        ) from exc
    if not items:
        raise ValueError(EMPTY_PARAMS)
    if all(isinstance(item, dict) for item in items):
        groups = items  # the caller's dicts, as torch.optim keeps them (issue 36: Lightning
        # 1.9 schedules the lr of the groups of the optimizer it rebuilds as OSS)
    elif any(isinstance(item, dict) for item in items):
        raise TypeError("params mixes param-group dicts and tensors: use one or the other")
    else:
        groups = [{"params": items}]
    seen: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param group {g} has no 'params' key")
        members = group["params"]
        if isinstance(members, torch.Tensor):
            members = [members]
        elif isinstance(members, set):
            raise TypeError(f"param group {g}: params must be an ordered sequence, not a set")
        group["params"] = members = list(members)
        for i, item in enumerate(members):
            tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            _check_param(tensor, g, i, seen)
    return groups


def _check_param(tensor: Any, g: int, i: int, seen: dict[int, tuple[int, int]]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"param {i} of group {g} is a {type(tensor).__name__}, not a tensor: "
            "pass model.parameters() or lists of tensors"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(
            f"param {i} of group {g} is a sparse tensor ({tensor.layout}): oss_plus shards "
            "dense parameters only"
        )
    if id(tensor) in seen:
        first = seen[id(tensor)]
        raise ValueError(
            f"param {i} of group {g} is the same tensor as param {first[1]} of group {first[0]}: "
            "list every parameter once"
        )
    seen[id(tensor)] = (g, i)


def describe_params(groups: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Return a short per-group description of every param (shape and dtype)."""
    return [
        [f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}" for p in g["params"]]
        for g in groups
    ]


def fingerprint(description: Iterable[Iterable[str]]) -> int:
    """Return a signed 63-bit hash of a description from :func:`describe_params`."""
    text = "|".join(",".join(group) for group in description)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def first_difference(mine: list[list[str]], other: list[list[str]]) -> str:
    """Describe where two descriptions from :func:`describe_params` differ first."""
    if len(mine) != len(other):
        return f"{len(mine)} param groups here, {len(other)} there"
    for g, (a, b) in enumerate(zip(mine, other)):
        if len(a) != len(b):
            return f"group {g} has {len(a)} params here, {len(b)} there"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"param {i} of group {g} is {x} here, {y} there"
    return "no difference in shapes and dtypes"


def check_same_model(
    param_groups: Sequence[dict[str, Any]] | None, error: Exception | None, group: Any
) -> None:
    """Raise on every rank if any rank failed validation or holds a different model.

    One all_gather of (error flag, fingerprint of the shapes and dtypes) per rank, through
    :func:`oss_plus.runtime.dist.agree`; the descriptions travel (as JSON bytes) only when the
    fingerprints differ. A rank that failed passes its ``error`` (and None groups).

    Raises:
        ValueError: the ranks of ``group`` hold different models (on every rank).

    .. warning:: Collective: call on every rank of ``group``.
    """
    description = describe_params(param_groups) if param_groups is not None else []
    prints = _dist.agree(error, group, value=fingerprint(description))
    if len(set(prints)) == 1:
        return
    descriptions = [
        json.loads(b) for b in _dist.all_gather_bytes(json.dumps(description).encode(), group)
    ]
    rank, members = dist.get_rank(group), _dist.group_members(group)
    other = next(r for r, d in enumerate(descriptions) if d != description)
    here, there = _dist.name_rank(members, rank), _dist.name_rank(members, other)
    raise ValueError(
        f"the ranks of the process group hold different models: {here} vs {there}: "
        f"{first_difference(description, descriptions[other])}. Build the same model on "
        "every rank before creating the optimizer"
    )


def param_specs(param_groups: Sequence[dict[str, Any]], aligned: bool) -> list[list[ParamSpec]]:
    """What planning needs of every param, per group: size, trainability, (device, dtype) key,
    alignment inside a bucket (1 when ``aligned`` is False) and shape (for the muon rule)."""
    return [
        [
            ParamSpec(
                p.numel(),
                p.requires_grad,
                key=f"{p.device}/{p.dtype}",
                align=alignment(p.device, p.dtype) if aligned else 1,
                shape=tuple(p.shape),
            )
            for p in g["params"]
        ]
        for g in param_groups
    ]


def agree_plan(plan: ShardPlan, error: Exception | None, group: Any) -> None:
    """Raise on every rank when a rank failed to build ``plan`` or the ranks hold different
    plans (:data:`PLANS_DIFFER`, the ranks grouped by plan); one small ``all_gather`` of the
    plans' fingerprints (a repartition is never per step).

    Raises:
        ValueError: the plans differ (on every rank).

    .. warning:: Collective: call on every rank of ``group``.
    """
    if dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    prints = _dist.agree(error, group, value=0 if error else plan.fingerprint())
    if len(set(prints)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(prints):
            groups.setdefault(value, []).append(rank)
        members = _dist.group_members(group)
        named = [[members[r] for r in same] for same in groups.values()]
        raise ValueError(PLANS_DIFFER.format(ranks=named))
