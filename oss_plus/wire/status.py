"""The step status that travels with the parameter sync, and the check that raises it.

Every rank sends a status code with the buckets of every sync: :data:`OK`, :data:`FAILED`
(its local step raised) or :data:`REPLAN` (its ``requires_grad`` mask changed: it did not
step and asks for a repartition). The code sits in the status slot that ends each of its
flat buckets (:mod:`oss_plus.wire.layout`), or in the last element of its region of an
``all_gather`` buffer. A layout where some rank sends no slot (it owns no trainable param,
the ``per_param`` layout, a flat-rule key with nothing to send) sends every rank's code in
one more small ``all_gather``, started with the buckets.

:class:`PeerSlots` is where a rank finds its peers' codes after a sync. The core never reads
them at once: after the waits it copies them to host memory (pinned, after an event, on
CUDA; :meth:`PeerSlots.stage`), and :class:`StepStatus` (owned by :class:`oss_plus.OSS`)
reads that copy at the library's next collective (the next ``step()``, ``clip_grad_norm``,
``consolidate_state_dict``, ``refresh_trainable``, the checkpoint entry points,
``settle()``), when the copy is long complete: no device-to-host read, no wait, no
collective per step while every rank reports :data:`OK`. Then, on every rank alike:

* a :data:`FAILED` code anywhere: :func:`oss_plus.runtime.dist.agree` (the one collective), which
  raises on every rank naming the failing rank(s) and the first one's message (the failing
  rank, which raised its own error at once, raises it again there);
* else a :data:`REPLAN` code: :data:`TRAINABILITY_DIFFERS`, with no collective (the codes
  name the ranks).

The step overlapped with DDP (:mod:`oss_plus.overlap`) still checks at once, with one read
(:meth:`PeerSlots.settle`): its error must leave ``backward()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime import dist as _dist
from oss_plus.wire.layout import Bucket, Gather, Transport

__all__ = [
    "FAILED",
    "OK",
    "REPLAN",
    "TRAINABILITY_DIFFERS",
    "PeerSlots",
    "StepStatus",
    "any_set",
    "slots",
]

#: Status codes a rank sends with its buckets.
OK, FAILED, REPLAN = 0, 1, 2

#: Raised on every rank when ``requires_grad`` changed on some ranks only before a step.
TRAINABILITY_DIFFERS = (
    "requires_grad changed on {changed} but not on {others} before the same "
    "step(), so the ranks would hold different shard plans: freeze or unfreeze the same "
    "params on every rank, then step again. That step was not applied on {changed} "
    "and was applied on the others (nothing is undone: reload a checkpoint to go on exactly)"
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def slots(
    buckets: Sequence[Bucket], gathers: Sequence[Gather], world_size: int
) -> list[tuple[int, torch.Tensor]]:
    """Return ``(rank, slot)`` for every status slot sent (the same list on every rank)."""
    found = [(rank, g.slot(rank)) for g in gathers if g.slots for rank in range(world_size)]
    found += [
        (b.owner, b.slot) for b in buckets if b.slot is not None and b.via is Transport.BROADCAST
    ]
    return found


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


class _Stage:
    """The peers' codes of one device on their way to the host: gathered on the device,
    copied without waiting into (pinned) host memory, an event after the copy."""

    def __init__(self, ranks: list[int], sources: list[torch.Tensor]) -> None:
        self.ranks, self.sources = ranks, sources
        device = sources[0].device
        cuda = device.type == "cuda"
        self.device = torch.empty(len(sources), device=device) if cuda else None
        self.host = torch.zeros(len(sources), pin_memory=cuda)
        self.values = self.host.numpy()  # read after the event, never as a tensor
        self.event = torch.cuda.Event() if cuda else None

    def stage(self) -> None:
        if self.device is None:
            torch.cat(self.sources, out=self.host)
            return
        torch.cat(self.sources, out=self.device)
        self.host.copy_(self.device, non_blocking=True)
        assert self.event is not None
        self.event.record()

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # recorded a whole step ago: normally complete
        return [int(v) for v in self.values]


class PeerSlots:
    """Where this rank finds its peers' status codes after a sync.

    Args:
        buckets: the layout's buckets.
        gathers: its ``all_gather`` buffers.
        group: the process group.
    """

    def __init__(self, buckets: Sequence[Bucket], gathers: Sequence[Gather], group: Any) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        first: dict[int, torch.Tensor] = {}  # every slot of an owner holds the same code
        for rank, slot in slots(buckets, gathers, self.world_size):
            first.setdefault(rank, slot)
        self.silent = len(first) < self.world_size
        self.vector: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.silent and self.world_size > 1:
            everyone = torch.zeros(self.world_size, device=_dist.comm_device(group))
            self.vector = (everyone[self.rank : self.rank + 1].clone(), everyone)
            first = {r: everyone[r : r + 1] for r in range(self.world_size)}
        self.peers = {r: s for r, s in first.items() if r != self.rank}
        by_device: dict[torch.device, list[int]] = {}
        for rank, slot in self.peers.items():
            by_device.setdefault(slot.device, []).append(rank)
        self._stages = [_Stage(rs, [self.peers[r] for r in rs]) for rs in by_device.values()]
        self.staged = False

    def send_vector(self, code: int) -> tuple[Any, list[torch.Tensor]] | None:
        """Start the ``all_gather`` of every rank's code when some rank sends no slot;
        return ``(work, tensors held)``, or None when the slots carry every code."""
        if self.vector is None:
            return None
        mine, everyone = self.vector
        mine.fill_(float(code))
        work = _all_gather_single(everyone, mine, group=self.group, async_op=True)
        return work, [mine, everyone]

    def stage(self) -> None:
        """After the waits: start copying the peers' codes to the host (no wait)."""
        for stage in self._stages:
            stage.stage()
        self.staged = True

    def codes(self, mine: int) -> list[int]:
        """Every rank's code of the last staged sync (``mine`` for this rank); waits for the
        copy (recorded after that sync) and reads host memory, no tensor."""
        codes = [OK] * self.world_size
        codes[self.rank] = mine
        for stage in self._stages:
            for rank, value in zip(stage.ranks, stage.read()):
                codes[rank] = value
        return codes

    def settle(self, error: BaseException | None, buckets: Sequence[Bucket] | None = None) -> None:
        """Check at once (the step overlapped with DDP): raise on every rank if any rank's
        step raised. Reads the peers' slots of ``buckets`` (default: of this layout) with one
        device-to-host read (:func:`any_set`); when one is set or ``error`` is given, or some
        rank sent no slot, runs :func:`oss_plus.runtime.dist.agree`. At world size 1 it reads
        nothing and re-raises ``error``.

        .. warning:: Collective: call on every rank of ``group`` after the same sends.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        if buckets is None:
            peers, silent = list(self.peers.values()), self.silent
        else:
            found = slots(buckets, (), self.world_size)
            peers = [s for r, s in found if r != self.rank]
            silent = len({r for r, _ in found}) < self.world_size
        if error is not None or silent or any_set(peers):
            _dist.agree(error, self.group)


class StepStatus:
    """What this rank's last step reported, raised on every rank at the next check.

    Args:
        group: the optimizer's process group.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self._code = OK
        self._error: BaseException | None = None
        self._source: PeerSlots | None = None

    @property
    def pending(self) -> bool:
        """Whether a sync's codes are waiting for :meth:`check`."""
        return self._source is not None

    def sent(self, code: int, error: BaseException | None, source: PeerSlots | None) -> None:
        """Remember the code this rank sent (and its error) and where its peers' codes were
        staged (None: nothing travelled)."""
        self._code, self._error, self._source = code, error, source

    def check(self) -> None:
        """Raise on every rank what the last staged sync reported (see the module doc).

        Raises:
            Exception: a rank's step failed (the failing rank's own error there, elsewhere
                one of the same type naming it; :func:`oss_plus.runtime.dist.agree`).
            ValueError: :data:`TRAINABILITY_DIFFERS`.

        .. warning:: Collective when a rank failed: call on every rank of ``group``.
        """
        source, code, error = self._source, self._code, self._error
        if source is None:
            return
        self.sent(OK, None, None)
        codes = source.codes(code)
        if FAILED in codes:
            _dist.agree(error, self.group)
        if REPLAN in codes:
            raise ValueError(replan_message(codes, _dist.group_members(self.group)))


def replan_message(codes: Sequence[int], members: Sequence[int] | None = None) -> str:
    """:data:`TRAINABILITY_DIFFERS` for the ranks' codes (PURE); ``members``: the global
    ranks of the group (default: numbered like the world).

    Example:
        >>> replan_message([2, 0, 2]).split(" but")[0]
        'requires_grad changed on global rank(s) [0, 2]'
        >>> replan_message([0, 2], [2, 3]).split(" but")[0]
        'requires_grad changed on global rank(s) [3] (rank(s) [1] of the group [2, 3])'
    """
    members = list(range(len(codes))) if members is None else members
    changed = [r for r, c in enumerate(codes) if c == REPLAN]
    others = [r for r, c in enumerate(codes) if c != REPLAN]
    return TRAINABILITY_DIFFERS.format(
        changed=_dist.name_ranks(members, changed), others=_dist.name_ranks(members, others)
    )
