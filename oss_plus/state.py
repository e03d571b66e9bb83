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
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "ParamState",
    "group_offsets",
    "local_view",
    "pack_param_groups",
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


def group_offsets(group_sizes: Sequence[int]) -> list[int]:
    """Return the flat index of the first parameter of every group.

    Example:
        >>> group_offsets([2, 0, 3])
        [0, 2, 2]
    """
    offsets, total = [], 0
    for size in group_sizes:
        offsets.append(total)
        total += size
    return offsets


def local_view(
    owners: Sequence[Sequence[int]], rank: int, orders: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Return, per group, the flat indices that ``rank`` owns, in visiting order.

    Args:
        owners: ``owners[g][i]`` as returned by :func:`oss_plus.partition.assign_owners`.
        rank: the rank whose view is wanted.
        orders: per group, the order in which the local optimizer holds the params
            (:meth:`oss_plus.partition.Rule.order`).

    Example:
        >>> local_view([[0, 1, 0], [1]], 0, [[0, 1, 2], [0]])
        [[0, 2], []]
    """
    offsets = group_offsets([len(g) for g in owners])
    return [
        [offsets[g] + i for i in order if owners[g][i] == rank] for g, order in enumerate(orders)
    ]


def pack_param_groups(param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return ``param_groups`` in state-dict form: hyperparameters plus flat indices.

    Hyperparameters are deep-copied, so the result never aliases the optimizer's groups.
    """
    packed, start = [], 0
    for group in param_groups:
        entry = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        packed.append(entry)
    return packed


def state_shape_error(index: int, key: str, value: torch.Tensor, shape: torch.Size) -> str | None:
    """Return an error message if a state tensor cannot belong to a param of ``shape``.

    Per-element state (momentum, Adam moments) has the param's shape. Factored state (e.g.
    Adafactor's row/column statistics) has the same number of dimensions with some of them
    reduced to 1, and scalar state (a step count) has no dimensions; both are accepted.
    """
    if value.dim() == 0 or value.dim() != len(shape):
        return None
    if all(v == s or v == 1 for v, s in zip(value.shape, shape)):
        return None
    return (
        f"state[{index}][{key!r}] has shape {tuple(value.shape)} but parameter {index} "
        f"has shape {tuple(shape)}: the state dict belongs to a different model"
    )


def validate_state_dict(
    state_dict: Mapping[str, Any], param_shapes: Sequence[Sequence[torch.Size]]
) -> None:
    """Check that ``state_dict`` fits parameters grouped as ``param_shapes``.

    Args:
        state_dict: a plain ``torch.optim`` state dict (from torch, fairscale OSS, torch ZeRO
            or oss_plus).
        param_shapes: per group, the shape of each parameter.

    Raises:
        ValueError: missing keys, a different number of groups, a group with a different
            number of params, a state entry for an unknown index, or a state tensor whose
            shape does not fit its parameter. The message names the group, index and shapes.
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
                message = state_shape_error(flat, key, value, flat_shapes[flat])
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
