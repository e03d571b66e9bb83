"""Small helpers around ``torch.distributed`` shared by the modules that communicate.

Every helper takes the process group explicitly; ranks are group-local unless a name says
``global``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: Message when no process group exists.
NOT_INITIALIZED = (
    "oss_plus needs an initialized torch.distributed process group: call "
    "torch.distributed.init_process_group(...) first (for a single process: "
    "init_process_group('gloo', init_method='tcp://127.0.0.1:29500', rank=0, world_size=1)), "
    "or launch with torchrun"
)


def resolve_group(group: Any) -> Any:
    """Return ``group``, or WORLD when it is None, after checking torch.distributed is ready.

    Raises:
        RuntimeError: no default process group has been initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(NOT_INITIALIZED)
    return dist.group.WORLD if group is None else group


def global_rank(group: Any, rank: int) -> int:
    """Return the global rank of group-local ``rank``."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def comm_device(group: Any) -> torch.device:
    """Return the device collectives on ``group`` must use (CUDA for NCCL, else CPU)."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: Raised on the ranks that did not fail themselves when a peer failed.
PEER_FAILED = (
    "rank(s) {ranks} of the process group failed (see their error); this rank stopped too "
    "so that no rank waits forever in a collective"
)


def any_rank(flag: bool, group: Any) -> list[bool]:
    """Return, for every rank of ``group``, the ``flag`` it passed (collective).

    Used so that an error one rank detects is raised on every rank instead of leaving the
    others blocked in the next collective.
    """
    world = dist.get_world_size(group)
    flags = torch.zeros(world, dtype=torch.int32, device=comm_device(group))
    flags[dist.get_rank(group)] = int(flag)
    dist.all_reduce(flags, group=group)
    return [bool(f) for f in flags.tolist()]


def raise_if_any(error: BaseException | None, group: Any) -> None:
    """Raise on every rank of ``group`` when ``error`` is set on any rank (collective).

    The rank that hit ``error`` re-raises it; the others raise RuntimeError naming the ranks.
    """
    failed = [r for r, f in enumerate(any_rank(error is not None, group)) if f]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(PEER_FAILED.format(ranks=failed))
