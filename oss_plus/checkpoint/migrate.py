"""The migration path: a plain ``torch.optim`` state dict (from ``torch.optim``, fairscale's
``OSS`` or torch's ``ZeroRedundancyOptimizer``, read with ``torch.load(..., weights_only=True)``)
written as a consolidated oss_plus checkpoint, atomically like
:func:`oss_plus.checkpoint.save.save_checkpoint`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from oss_plus.checkpoint import storage
from oss_plus.checkpoint.format import CONSOLIDATED, Index, encode_groups
from oss_plus.checkpoint.plan import SavePlan, split_state
from oss_plus.checkpoint.save import commit
from oss_plus.checkpoint.values import encode_value
from oss_plus.state.extras import detach
from oss_plus.state.index import NOT_A_STATE_DICT, pack_param_groups, saved_state_by_flat_index

__all__ = ["write_state_dict"]


def write_state_dict(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write a plain ``torch.optim`` state dict as a consolidated oss_plus checkpoint.

    The migration path for existing checkpoints: a dict from ``torch.optim``, from fairscale's
    ``OSS.state_dict()`` or from torch's ``ZeroRedundancyOptimizer.state_dict()``, e.g. read
    from a ``.pt`` file with ``torch.load(file, weights_only=True)``. The write is atomic like
    :func:`save_checkpoint`. Param shapes are not recorded (a plain dict does not have them);
    loading still checks the state tensors against the params.

    Args:
        state_dict: ``{"state": {id: {key: value}}, "param_groups": [...]}``; not modified.
        path: the checkpoint directory.
        progress: called with ``(bytes written, bytes total)`` as the tensors are written.

    Raises:
        ValueError: ``state_dict`` is not in the torch.optim format.
        TypeError: a value cannot be stored (checked before anything is written).

    Example:
        >>> sd = torch.load("optim.pt", map_location="cpu", weights_only=True)  # doctest: +SKIP
        >>> write_state_dict(sd, "ckpt/migrated")  # doctest: +SKIP
    """
    from oss_plus import __version__

    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        keys = (
            sorted(map(str, state_dict))
            if isinstance(state_dict, Mapping)
            else type(state_dict).__name__
        )
        raise ValueError(NOT_A_STATE_DICT.format(keys=keys))
    try:
        form, extras = detach(state_dict)  # extra keys, state not keyed by a param
        by_flat = saved_state_by_flat_index(form)
        groups = pack_param_groups(form["param_groups"])
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"the state dict is not in the torch.optim format ({type(exc).__name__}: {exc}): "
            "every param group needs a 'params' list and every state id must be listed in one"
        ) from None
    entries, save_id = split_state(by_flat), storage.new_save_id()
    index = Index(CONSOLIDATED, save_id, groups, {}, {}, created_by=f"oss_plus {__version__}")
    if not extras.empty:
        index = replace(index, extras={"common": encode_value(extras.to_value(), "extras")})
    encode_groups(groups, "param_groups")
    plan = SavePlan(Path(os.path.abspath(path)), save_id, 0, 1, entries, index)
    storage.prepare_stage(plan.target, save_id)
    try:
        size, written = storage.write_file(plan.stage / plan.file_name, entries, save_id, progress)
        files = {plan.file_name: {"rank": 0, "bytes": size}}
        replaced = commit(plan, replace(index, files=files, state=written))
    except BaseException:
        storage.remove_stage(plan.target, save_id)
        raise
    storage.remove_replaced(plan.target, replaced)
