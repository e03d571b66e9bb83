"""The step status that travels with the parameter sync: which rank's local step failed.

Every flat bucket (and every rank's region of an ``all_gather`` buffer) ends with a status
slot (:mod:`oss_plus._layout`) its owner sets to 1 when its local step raised. After the
waits, every rank reads the slots of its peers with ONE device-to-host read (one slot per
peer, gathered on the device first, :func:`any_set`); when any is set (or this rank
failed), every rank runs :func:`oss_plus._dist.agree`, which raises on all of them naming
the failing rank(s). So a failure costs no collective in the common case. When some rank
sends no slot (it owns no trainable param, or the layout is ``per_param``), that one
``agree`` (one ``all_gather``, one read) runs at every sync instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oss_plus import _dist
from oss_plus._layout import Bucket, Gather, Transport

__all__ = ["PeerSlots", "any_set", "slots"]


def slots(
    buckets: Sequence[Bucket], gathers: Sequence[Gather], world_size: int
) -> list[tuple[int, torch.Tensor]]:
    """Return ``(rank, slot)`` for every status slot sent (the same list on every rank)."""
    found = [(rank, g.slot(rank)) for g in gathers if g.slots for rank in range(world_size)]
    found += [
        (b.owner, b.slot) for b in buckets if b.slot is not None and b.via is Transport.BROADCAST
    ]
    return found


def _first_per_rank(found: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    first: dict[int, torch.Tensor] = {}
    for rank, slot in found:
        first.setdefault(rank, slot)
    return list(first.items())


def any_set(peers: Sequence[torch.Tensor]) -> bool:
    """Return whether any status slot is set, with at most one device-to-host read.

    The slots (one element each, one device) are gathered on their device first, so the
    host waits for the device once however many peers there are; no slots read nothing.

    Example:
        >>> any_set([torch.zeros(1), torch.ones(1)]), any_set([])
        (True, False)
    """
    if not peers:
        return False
    if len(peers) == 1:
        return bool(peers[0])
    return bool(torch.cat(list(peers)).any())


class PeerSlots:
    """The status slots this rank reads after a sync: one per peer (every slot of an owner
    holds the same status after a sync), and whether some rank sends none.

    Args:
        buckets: the layout's buckets.
        gathers: its ``all_gather`` buffers.
        rank: this rank.
        world_size: the group's size.
    """

    def __init__(
        self, buckets: Sequence[Bucket], gathers: Sequence[Gather], rank: int, world_size: int
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        reporters = _first_per_rank(slots(buckets, gathers, world_size))
        self.peers = [s for r, s in reporters if r != rank]
        self.silent = len(reporters) < world_size

    def settle(
        self, error: BaseException | None, group: object, buckets: Sequence[Bucket] | None = None
    ) -> None:
        """After the waits: raise on every rank if any rank's step raised.

        Reads the status slots of the peers (every slot of ``buckets``, default: one per
        rank of this layout) with one device-to-host read (:func:`any_set`); when one is set
        or ``error`` is given, or some rank sent no slot, runs :func:`oss_plus._dist.agree`,
        which raises on every rank naming the failing rank(s). At world size 1 it reads
        nothing and re-raises ``error``.

        .. warning:: Collective: call on every rank of ``group`` after the same sends.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        if buckets is None:
            peers, silent = self.peers, self.silent
        else:
            found = slots(buckets, (), self.world_size)
            peers = [s for r, s in found if r != self.rank]
            silent = len({r for r, _ in found}) < self.world_size
        if error is not None or silent or any_set(peers):
            _dist.agree(error, group)
