"""Global <-> local index translation and state-dict splitting: pure functions, no collectives.

Vocabulary:

* the **flat index** of a parameter is its position when the global ``param_groups`` are
  concatenated; it is the key of ``state`` in the plain ``torch.optim`` state-dict format and
  it does not depend on the world size;
* a rank's **local view** lists, per global group, the flat indices that rank owns, in the
  order its inner optimizer holds them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# also for the 0.2 paths oss_plus.state.group_offsets / local_view (oss_plus._moved), until 0.4
from oss_plus.planning.partition import group_offsets, local_view
from oss_plus.state.extras import detach
from oss_plus.state.nested import map_storages
from oss_plus.state.subclass import clone_tensor

__all__ = [
    "NOT_HYPER",
    "ParamState",
    "copy_hyper",
    "group_offsets",
    "local_groups",
    "local_state_dict",
    "local_view",
    "own_group_keys",
    "pack_param_groups",
    "per_element_keys",
    "PER_ELEMENT_KEYS",
    "place_states",
    "validate_state_dict",
    "state_shape_error",
]

#: The optimizer state of one parameter: key -> tensor or plain value.
ParamState = dict[str, Any]

#: Message for a state dict without the two keys of the torch.optim format.
NOT_A_STATE_DICT = (
    "expected an optimizer state dict with keys 'state' and 'param_groups' "
    "(the torch.optim format), got keys {keys}"
)


#: Keys of a param group that are not hyperparameters.
NOT_HYPER = ("params", "param_names")


def copy_hyper(
    src: Sequence[Mapping[str, Any]],
    dst: Sequence[dict[str, Any]],
    exclude: tuple[str, ...] = NOT_HYPER,
) -> None:
    """Copy every key but ``exclude`` from each group of ``src`` to the same group of ``dst``.

    Values are assigned, not copied (a scheduler's tensor ``lr`` stays one object).

    Example:
        >>> dst = [{"params": [1], "lr": 0.1}]
        >>> copy_hyper([{"params": [], "lr": 0.5}], dst); dst
        [{'params': [1], 'lr': 0.5}]
    """
    for s, d in zip(src, dst):
        for key, value in s.items():
            if key not in exclude:
                d[key] = value


def local_groups(
    param_groups: Sequence[Mapping[str, Any]],
    indices: Sequence[Sequence[int]],
    params: Sequence[Any],
) -> list[dict[str, Any]]:
    """Return one rank's param groups: every global group restricted to ``indices[g]``.

    Hyperparameters are shared with the global groups (not copied); ``param_names`` (when
    the groups have them) are restricted like the params.

    Example:
        >>> local_groups([{"params": ["a", "b"], "lr": 1}], [[1]], ["a", "b"])
        [{'lr': 1, 'params': ['b']}]
    """
    names = [n for g in param_groups for n in g.get("param_names", ())]
    groups = []
    for g, members in enumerate(indices):
        local = {k: v for k, v in param_groups[g].items() if k not in NOT_HYPER}
        local["params"] = [params[i] for i in members]
        if "param_names" in param_groups[g]:
            local["param_names"] = [names[i] for i in members]
        groups.append(local)
    return groups


def local_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    indices: Sequence[Sequence[int]],
    states: Mapping[int, ParamState],
    copy_tensors: bool,
) -> dict[str, Any]:
    """Return the state dict one rank's inner optimizer would hold (local positions).

    Args:
        param_groups: the global groups (hyperparameters are deep-copied from them).
        indices: the rank's local view (per group, flat indices in inner order).
        states: flat index -> state; entries outside the view are ignored.
        copy_tensors: clone the tensors (else they are shared).

    Example:
        >>> sd = local_state_dict([{"params": [0, 1], "lr": 1}], [[1]], {1: {"n": 2}}, False)
        >>> sd
        {'state': {0: {'n': 2}}, 'param_groups': [{'lr': 1, 'params': [0]}]}
    """
    names = [n for g in param_groups for n in g.get("param_names", ())]
    state: dict[int, ParamState] = {}
    packed: list[dict[str, Any]] = []
    position = 0
    for g, members in enumerate(indices):
        entry = {k: copy.deepcopy(v) for k, v in param_groups[g].items() if k not in NOT_HYPER}
        if "param_names" in param_groups[g]:
            entry["param_names"] = [names[i] for i in members]
        entry["params"] = list(range(position, position + len(members)))
        packed.append(entry)
        for offset, index in enumerate(members):
            if index in states:
                state[position + offset] = {
                    k: map_storages(v, clone_tensor) if copy_tensors else v
                    for k, v in states[index].items()
                }
        position += len(members)
    return {"state": state, "param_groups": packed}


def place_states(
    inner: Any, params: Sequence[torch.Tensor], states: Mapping[int, ParamState]
) -> None:
    """Give the optimizer ``inner`` the ``states`` of its params (flat index -> state).

    Tensors (also those nested in lists, tuples and dicts) move to the param's device,
    except 0-dim ones (a ``step`` count), which stay on CPU unless the param's group is
    ``fused`` or ``capturable`` (torch's own policy).
    """
    group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
    for index, state in states.items():
        param = params[index]
        group = group_of[id(param)]
        on_device = bool(group.get("fused") or group.get("capturable"))
        place = functools.partial(_place, device=param.device, scalars_on_device=on_device)
        inner.state[param] = {k: map_storages(v, place) for k, v in state.items()}


def _place(value: torch.Tensor, device: torch.device, scalars_on_device: bool) -> torch.Tensor:
    return value.to(device if value.dim() > 0 or scalars_on_device else "cpu")


def own_group_keys(inner: Any) -> list[frozenset[str]] | None:
    """The keys each param group keeps in ``inner``'s own ``state_dict()`` when its class
    overrides it (heavyball's drops its ``_``-prefixed keys, ``__class__`` among them),
    else None (every key).

    Example:
        >>> own_group_keys(torch.optim.SGD([torch.zeros(1)])) is None
        True
    """
    if getattr(type(inner), "state_dict", None) is torch.optim.Optimizer.state_dict:
        return None
    form, _ = detach(inner.state_dict())  # a wrapper's groups may be nested (Lookahead)
    return [frozenset(g) for g in form["param_groups"]]


def pack_param_groups(
    param_groups: Sequence[Mapping[str, Any]],
    keys: Sequence[frozenset[str]] | None = None,
) -> list[dict[str, Any]]:
    """Return ``param_groups`` in state-dict form: hyperparameters plus flat indices.

    Hyperparameters are deep-copied, so the result never aliases the optimizer's groups.
    With ``keys`` (:func:`own_group_keys`), a group keeps only the keys listed for it.
    """
    packed, start = [], 0
    for g, group in enumerate(param_groups):
        kept = keys[g] if keys is not None and g < len(keys) else None
        entry = {
            k: copy.deepcopy(v)
            for k, v in group.items()
            if k != "params" and (kept is None or k in kept)
        }
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        packed.append(entry)
    return packed


#: State keys that hold one value per element of the param (the param's exact shape), for
#: the ``torch.optim`` classes (exact classes only: a subclass may give a key another
#: meaning). Other state, and the state of any other optimizer, may have any shape (a
#: ``(3,)`` histogram on a bias, factored or low-rank statistics) and is not checked.
PER_ELEMENT_KEYS: dict[type[torch.optim.Optimizer], frozenset[str]] = {
    cls: frozenset(keys)
    for cls, keys in (
        (torch.optim.Adadelta, ("square_avg", "acc_delta")),
        (torch.optim.Adagrad, ("sum",)),
        (torch.optim.Adam, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        (torch.optim.AdamW, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        (torch.optim.Adamax, ("exp_avg", "exp_inf")),
        (torch.optim.ASGD, ("ax",)),
        (torch.optim.NAdam, ("exp_avg", "exp_avg_sq")),
        (torch.optim.RAdam, ("exp_avg", "exp_avg_sq")),
        (torch.optim.RMSprop, ("square_avg", "momentum_buffer", "grad_avg")),
        (torch.optim.Rprop, ("prev", "step_size")),
        (torch.optim.SGD, ("momentum_buffer",)),
        (torch.optim.SparseAdam, ("exp_avg", "exp_avg_sq")),
    )
}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    PER_ELEMENT_KEYS[torch.optim.Adafactor] = frozenset({"variance"})
if hasattr(torch.optim, "Muon"):
    PER_ELEMENT_KEYS[torch.optim.Muon] = frozenset({"momentum_buffer"})


def per_element_keys(optimizer: Any) -> frozenset[str]:
    """Return the per-element state keys of ``optimizer`` (a class or an instance).

    Example:
        >>> sorted(per_element_keys(torch.optim.SGD))
        ['momentum_buffer']
        >>> per_element_keys(object())
        frozenset()
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return PER_ELEMENT_KEYS.get(cls, frozenset())


def state_shape_error(
    index: int,
    key: str,
    value: torch.Tensor,
    shape: torch.Size,
    per_element: frozenset[str] | set[str] = frozenset(),
) -> str | None:
    """Return an error message if a state tensor cannot belong to a param of ``shape``.

    Only a key of ``per_element`` (from :func:`per_element_keys`) is checked: it must have
    the param's exact shape. Any other state may legally have any shape (a fixed-size
    histogram, factored or low-rank statistics, a step count), so it is accepted.

    Example:
        >>> state_shape_error(0, "hist", torch.zeros(3), torch.Size([5])) is None
        True
        >>> state_shape_error(0, "exp_avg", torch.zeros(3), torch.Size([5]), {"exp_avg"})[:32]
        "state[0]['exp_avg'] has shape (3"
    """
    if key not in per_element or tuple(value.shape) == tuple(shape):
        return None
    return (
        f"state[{index}][{key!r}] has shape {tuple(value.shape)} but parameter {index} "
        f"has shape {tuple(shape)}: the state dict belongs to a different model"
    )


def validate_state_dict(
    state_dict: Mapping[str, Any],
    param_shapes: Sequence[Sequence[torch.Size]],
    per_element: frozenset[str] = frozenset(),
) -> None:
    """Check that ``state_dict`` fits parameters grouped as ``param_shapes``.

    Args:
        state_dict: a plain ``torch.optim`` state dict (from torch, fairscale OSS, torch ZeRO
            or oss_plus).
        param_shapes: per group, the shape of each parameter.
        per_element: state keys that must have their param's shape
            (:func:`per_element_keys` of the optimizer that will hold the state).

    Raises:
        ValueError: missing keys, a different number of groups, a group with a different
            number of params, a state entry for an unknown index, or a per-element state
            tensor whose shape is not its parameter's. The message names the group, index
            and shapes.
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(NOT_A_STATE_DICT.format(keys=keys))
    saved = state_dict["param_groups"]
    if len(saved) != len(param_shapes):
        raise ValueError(
            f"the state dict has {len(saved)} param groups but the optimizer has "
            f"{len(param_shapes)}: load a state dict saved from the same model and groups"
        )
    for g, (group, shapes) in enumerate(zip(saved, param_shapes)):
        if len(group["params"]) != len(shapes):
            raise ValueError(
                f"param group {g} of the state dict has {len(group['params'])} params but the "
                f"optimizer's group {g} has {len(shapes)}"
            )
    flat_shapes = [s for shapes in param_shapes for s in shapes]
    saved_ids = [i for group in saved for i in group["params"]]
    id_to_flat = {saved_id: flat for flat, saved_id in enumerate(saved_ids)}
    for saved_id, param_state in state_dict["state"].items():
        if saved_id not in id_to_flat:
            raise ValueError(
                f"the state dict has state for param id {saved_id!r}, which no param group lists"
            )
        flat = id_to_flat[saved_id]
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                message = state_shape_error(flat, key, value, flat_shapes[flat], per_element)
                if message:
                    raise ValueError(message)


def saved_state_by_flat_index(state_dict: Mapping[str, Any]) -> dict[int, ParamState]:
    """Return the state of ``state_dict`` keyed by flat index (ids mapped by group position).

    ``state_dict`` is not modified; the inner dicts are new, the tensors are shared.
    """
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    id_to_flat = {saved_id: flat for flat, saved_id in enumerate(saved_ids)}
    return {
        id_to_flat[saved_id]: dict(param_state)
        for saved_id, param_state in state_dict["state"].items()
    }
