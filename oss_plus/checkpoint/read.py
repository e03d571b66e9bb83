"""Reading checkpoints: :func:`load_checkpoint` and :func:`read_state_dict`.

No pickle: the index is JSON, tensors come from ``safe_open`` one by one, and only the
tensors asked for are read (each rank reads the params it owns now, so any world size loads
any checkpoint). Both functions first validate the checkpoint
(:mod:`~oss_plus.checkpoint.validate`), then read the state they need
(:mod:`~oss_plus.checkpoint.assemble`). The only collectives are the two phases of
:func:`load_checkpoint`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from oss_plus.checkpoint.assemble import read_states
from oss_plus.checkpoint.extras import for_rank, plain_extras
from oss_plus.checkpoint.fit import check_groups
from oss_plus.checkpoint.format import INDEX_FILE
from oss_plus.checkpoint.plan import check_optimizer, local_pieces
from oss_plus.checkpoint.validate import check_files, check_fits, read_index
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.state.extras import Extras, attach
from oss_plus.state.index import per_element_keys
from oss_plus.wire.main.region import MAIN_KEY

__all__ = ["load_checkpoint", "read_state_dict"]

logger = logging.getLogger(__name__)


def load_checkpoint(
    optimizer: Any, path: str | os.PathLike[str], *, allow_other_optimizer: bool = False
) -> None:
    """Load a checkpoint saved by :func:`save_checkpoint` or :func:`write_state_dict`.

    Works for both layouts at any world size and under any partition rule, whatever the
    rule that saved it: each rank reads (lazily, with ``safe_open``) only the tensors of the
    params it owns now, and checks their dtype, shape and checksum. State stored as pieces
    (``partition_rule="flat"``) is stitched for a param this rank holds whole; of a param
    it holds a piece of (flat rule), only the stored elements of that piece are read (a
    stored tensor larger than
    :data:`~oss_plus.checkpoint.assemble.PARTIAL_READ_BYTES` needed in part is read with
    ``get_slice``, which checks dtype and shape but not the checksum).
    Param groups are restored exactly (``betas`` stays a tuple, ints stay ints) and
    non-tensor state comes from JSON; nothing is unpickled. Everything is validated before
    the optimizer is touched; an error on any rank is raised on every rank: the index's
    checksum (format version 5), every required field, every saved group against the inner
    optimizer's hyperparameters (its ``defaults``: each must be there with a value of its
    type; other keys, a scheduler's ``initial_lr``, load as torch loads them), and every
    tensor of the data files against the entries that claim them.

    A checkpoint of another optimizer class is refused, naming both classes: always when
    its groups lack the loading optimizer's hyperparameters (``SGD`` into ``AdamW``), and
    unless ``allow_other_optimizer`` when they do not (``Adam`` into ``AdamW``); with it,
    every saved hyperparameter is loaded as saved (Adam's ``weight_decay`` and
    ``decoupled_weight_decay=False``), as ``load_state_dict`` would.

    Args:
        optimizer: the :class:`oss_plus.OSS` optimizer over the same model and param groups.
        path: the checkpoint directory.
        allow_other_optimizer: load a checkpoint saved from another inner optimizer class
            whose param groups fit this one's, with the saved hyperparameters.

    Raises:
        TypeError: ``optimizer`` is not an OSS.
        FileNotFoundError: no checkpoint at ``path``, or one of its files is missing.
        NotADirectoryError: ``path`` is a file.
        ValueError: a truncated or corrupted file, a damaged index (checksum, a missing or
            mistyped field or hyperparameter, a stored tensor no entry claims), an index of
            another format version, pieces that do not cover their tensor, a checkpoint of
            a different model (count, shape or dtype mismatch) or of another optimizer
            class; the message names the file, the entry and the fix.

    Example:
        >>> load_checkpoint(opt, "ckpt/step_1000")  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    check_optimizer(optimizer, "load_checkpoint")
    with _arrival.entry(optimizer.group, "load_checkpoint()", steps=optimizer.step_count):
        _load(optimizer, Path(path), allow_other_optimizer)


def _load(optimizer: Any, root: Path, allow_other: bool) -> None:
    """The body of :func:`load_checkpoint`, once every rank entered it."""
    optimizer.settle()  # the last step's sync done and its status raised on every rank

    def read() -> tuple[list[dict[str, Any]], Extras | None, dict[int, dict[str, Any]]]:
        index = read_index(root)
        check_files(root, index)
        shapes = [[p.shape for p in g["params"]] for g in optimizer.param_groups]
        dtypes = [p.dtype for p in optimizer.flat_params()]
        per_element = per_element_keys(optimizer.optim) | {MAIN_KEY}  # exact values too
        check_fits(index, shapes, dtypes, str(root / INDEX_FILE), per_element)
        groups = check_groups(index, optimizer, str(root / INDEX_FILE), allow_other)
        groups, extras = for_rank(index, optimizer, groups, str(root / INDEX_FILE))
        pieces = {i: (start, end) for i, (start, end, _) in local_pieces(optimizer).items()}
        shapes_by_index = [tuple(s) for group in shapes for s in group]
        owned = optimizer.plan.owned(optimizer.rank)
        return groups, extras, read_states(root, index, owned, pieces, shapes_by_index)

    groups, extras, states = _dist.run_phase(read, optimizer.group)
    _dist.run_phase(
        lambda: optimizer.import_local_state(states, groups, extras=extras), optimizer.group
    )


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the checkpoint at ``path`` as a plain ``torch.optim`` state dict.

    Needs no process group. The result equals the consolidated ``state_dict()`` of the
    optimizer that saved it (dtypes included; state saved as pieces is stitched into whole
    tensors) and loads into a plain torch optimizer, an
    :class:`oss_plus.OSS`, fairscale's OSS or torch's ZeroRedundancyOptimizer. Every tensor
    is checksummed; nothing is unpickled.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` or a missing file.
        ValueError: a truncated or corrupted file, an index of another format version, or
            pieces that do not cover their tensor.

    Example:
        >>> torch_optimizer.load_state_dict(read_state_dict("ckpt/step_1000"))  # doctest: +SKIP
    """
    root = Path(path)
    index = read_index(root)
    check_files(root, index)
    extras = plain_extras(index, str(root / INDEX_FILE))
    state = read_states(root, index, range(index.num_params))
    form = {"state": state, "param_groups": index.param_groups}
    return form if extras is None else attach(form, extras)
