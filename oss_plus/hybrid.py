"""Hybrid sharding: shard inside a group of ranks (a node), replicate across such groups.

The world is tiled twice: by *shard groups* (``S`` ranks that together hold one copy of the
optimizer state, each ``1/S`` of it) and by *replicate groups* (the ``R = world / S`` ranks
that hold the same shard: one from every shard group, at the same shard-group rank). This is
FSDP's ``HYBRID_SHARD`` and FSDP2's 2-D mesh ``(replicate, shard)``.

The core plans and syncs within the shard group only (it never sees the replicate group);
the replicate group matters to the collaborators: a checkpoint is written by one replica set
(:mod:`oss_plus.checkpoint.save`), and gradient sharding sums each owner's reduced gradients
across its replica group. Clipping and consolidation stay within the shard group: every
replica set holds the same gradients and state, so each counts every gradient exactly once.

:func:`hybrid_groups` builds both groups; :func:`check_groups` (what ``OSS`` calls) checks
that given groups tile the world, raising the same error on every rank.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from oss_plus.runtime import dist as _dist

__all__ = [
    "GROUPS_DO_NOT_TILE",
    "NO_SHARD_SIZE",
    "HybridGroups",
    "check_groups",
    "hybrid_groups",
    "is_writer",
]

#: The shard size is missing (no ``LOCAL_WORLD_SIZE``) or does not divide the world.
NO_SHARD_SIZE = (
    "hybrid_groups(shard_size={given!r}) at world size {world}: expected a positive shard "
    "size that divides the world size{why}; pass shard_size= (the ranks of a node, e.g. 8) "
    "or launch with torchrun, which sets LOCAL_WORLD_SIZE"
)
#: Some rank's process groups are not a shard group and a replicate group tiling the world.
GROUPS_DO_NOT_TILE = (
    "OSS(group=..., replicate_group=...): the groups do not tile the world of {world} ranks: "
    "{problem}. Expected every rank in one shard group of S ranks and one replicate group of "
    "world/S ranks holding the same shard-group rank (the ranks that hold the same shard); "
    "build them with oss_plus.hybrid_groups(shard_size) on every rank"
)


class HybridGroups(NamedTuple):
    """The two groups of this rank: pass ``group=shard`` and ``replicate_group=replicate``."""

    shard: Any
    replicate: Any


def hybrid_groups(shard_size: int | Any | None = None) -> HybridGroups:
    """Build this rank's shard group and replicate group for the current world.

    Shard groups are contiguous ranks (``[0, S)``, ``[S, 2S)``, ...: the ranks of a node under
    torchrun); replicate group ``j`` holds rank ``j`` of every shard group. Every rank creates
    every group, in the same order (``dist.new_group`` is collective over the world).

    Args:
        shard_size: ranks per shard group (default: ``LOCAL_WORLD_SIZE``, the node), or a
            2-D :class:`torch.distributed.device_mesh.DeviceMesh` with dims
            ``(replicate, shard)`` (as FSDP2's ``fully_shard(mesh=...)`` takes it), whose
            groups are used as they are.

    Returns:
        :class:`HybridGroups` ``(shard, replicate)`` of this rank.

    Raises:
        ValueError: no shard size (``LOCAL_WORLD_SIZE`` unset), one that does not divide the
            world size, or a mesh that is not 2-D (raised on every rank alike).

    Example:
        >>> shard, replicate = hybrid_groups()  # doctest: +SKIP
        >>> opt = OSS(params, group=shard, replicate_group=replicate)  # doctest: +SKIP

    .. warning:: Collective: call on every rank of the world.
    """
    if hasattr(shard_size, "get_group") and hasattr(shard_size, "ndim"):
        return _from_mesh(shard_size)
    world = dist.get_world_size()
    why = ""
    if shard_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        shard_size = int(local) if local.isdigit() else None
        why = "" if shard_size else " (LOCAL_WORLD_SIZE is not set)"
    if not isinstance(shard_size, int) or shard_size <= 0 or world % shard_size:
        raise ValueError(NO_SHARD_SIZE.format(given=shard_size, world=world, why=why))
    rank, size = dist.get_rank(), shard_size
    shard = replicate = None
    for start in range(0, world, size):
        made = dist.new_group(list(range(start, start + size)))
        shard = made if start <= rank < start + size else shard
    for offset in range(size):
        made = dist.new_group(list(range(offset, world, size)))
        replicate = made if rank % size == offset else replicate
    return HybridGroups(shard, replicate)


def _from_mesh(mesh: Any) -> HybridGroups:
    if mesh.ndim != 2:
        raise ValueError(
            f"hybrid_groups(mesh): expected a 2-D DeviceMesh with dims (replicate, shard), got "
            f"{mesh.ndim} dims {tuple(mesh.shape)}; build one with init_device_mesh(device, "
            "(nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))"
        )
    return HybridGroups(mesh.get_group(1), mesh.get_group(0))


def check_groups(shard_group: Any, replicate_group: Any) -> None:
    """Check that the groups of every rank tile the world (one small all_gather over it).

    Every rank contributes its shard group (size, rank, first global rank) and its replicate
    group (size, rank, first global rank); every rank checks the whole table the same way,
    so a mistake on one rank raises the same ValueError on every rank.

    Raises:
        ValueError: :data:`GROUPS_DO_NOT_TILE` (naming the first problem found).

    .. warning:: Collective: call on every rank of the world.
    """
    world = dist.get_world_size()
    row = _row(shard_group) + _row(replicate_group)
    device = _dist.comm_device(dist.group.WORLD)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    with _dist.released(dist.group.WORLD, mine, *gathered):
        dist.all_gather(gathered, mine)
    problem = _problem(torch.stack(gathered).tolist(), world)
    if problem is not None:
        raise ValueError(GROUPS_DO_NOT_TILE.format(world=world, problem=problem))


def _row(group: Any) -> list[int]:
    """(size, rank in it, its first global rank), rank -1 for a non-member."""
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError, TypeError):  # not a group of this rank
        return [0, -1, -1]
    return [len(ranks), dist.get_rank(group), min(ranks)]


def _problem(rows: list[list[int]], world: int) -> str | None:
    """The first way the gathered rows fail to tile the world (pure), or None."""
    for rank, (s_size, s_rank, _, r_size, r_rank, _) in enumerate(rows):
        if s_rank < 0 or r_rank < 0:
            which = "shard group" if s_rank < 0 else "replicate group"
            return f"rank {rank} is not a member of its {which}"
        if s_size * r_size != world:
            return (
                f"rank {rank} has a shard group of {s_size} and a replicate group of {r_size} "
                f"ranks: {s_size} x {r_size} != {world}"
            )
    for col, which in ((2, "shard group"), (5, "replicate group")):
        members: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            members.setdefault(row[col], []).append(rank)
        for first, ranks in members.items():
            size = rows[ranks[0]][col - 2]
            local = sorted(rows[r][col - 1] for r in ranks)
            if local != list(range(size)):
                return f"the {which} starting at rank {first} holds ranks {ranks}, not {size}"
    shard_rank: dict[int, set[int]] = {}
    for row in rows:
        shard_rank.setdefault(row[5], set()).add(row[1])
    for first, held in shard_rank.items():
        if len(held) != 1:
            return (
                f"the replicate group starting at rank {first} holds shard-group ranks "
                f"{sorted(held)}: its ranks hold different shards"
            )
    return None


def is_writer(optimizer: Any) -> bool:
    """Whether this rank's replica set writes checkpoints (replicate-group rank 0; always
    without a replicate group)."""
    replicate = getattr(optimizer, "replicate_group", None)
    return replicate is None or dist.get_rank(replicate) == 0
