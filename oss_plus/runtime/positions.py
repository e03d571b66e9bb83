"""Where each rank of a group is, told out of band when a collective call cannot complete.

A rank that skipped a ``step()`` (or called it twice, or called another collective entry
point meanwhile) leaves its peers in a call it never makes. Those peers cannot ask it over the
process group (its collectives are out of step: a message would pair with the wrong call), so
each rank tells the default process group's key-value store where it is, and only when it is
about to give up: a rank waiting in :mod:`oss_plus.runtime.arrival` posts its call when it
starts to wait; a ``step()`` whose sync did not complete within the arrival timeout posts its
step when it gives up. Nothing is posted while every call completes in time, so a step costs
nothing here.

:func:`report` posts this rank's position and collects the others' (each waits at most
:func:`grace` for the late ones); :func:`describe` names them.

Example:
    >>> describe([0, 1, 2], {0: "in step() (its step 3)", 1: None}, me=2)
    'global rank 0 is in step() (its step 3); global rank 1 is in no collective call of \
oss_plus (nothing reported); global rank 2 (this rank) is here'
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = [
    "GRACE_S",
    "NOT_MATCHED",
    "NOT_REPORTED",
    "clear",
    "default_store",
    "describe",
    "first_line",
    "grace",
    "post",
    "report",
    "wait",
    "where",
]

#: A rank that posted no position (:func:`describe`).
NOT_REPORTED = "is in no collective call of oss_plus (nothing reported)"

#: Raised by :func:`wait` when a collective of ``what`` did not complete in time.
NOT_MATCHED = (
    "{what} is collective, but one of its collectives did not complete on this rank "
    "({error}; the arrival timeout is {seconds:g}s). Where the ranks are: {where}. Every rank "
    "must make the same collective calls in the same order: a rank skipped a step() or "
    "called it twice, or made another collective call meanwhile. The process group is left "
    "with a collective half done: restart from a checkpoint (a rank that is only slow needs "
    "a longer OSS_PLUS_ARRIVAL_TIMEOUT)"
)

#: How long a rank that gives up waits, at most, for the positions of the others.
GRACE_S = 5.0

_POLL_S = 0.05
#: The keys this process posted a position under and has not cleared.
_posted: set[str] = set()


def default_store() -> Any | None:
    """Return the default process group's store (None where torch does not expose it)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def where(group: Any, mine: str, timeout: timedelta) -> str:
    """Post this rank's position ``mine`` and name every rank's (:func:`report`,
    :func:`describe`); ``"unknown"`` where the store is not exposed.

    .. warning:: Waits up to :func:`grace` for the other ranks to post theirs.
    """
    store = default_store()
    if store is None:
        return "unknown"
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me = ranks[dist.get_rank(group)]
    return describe(ranks, report(store, ranks, me, mine, timeout), me)


def first_line(exc: BaseException) -> str:
    """The first line of what a backend raised (gloo's "Operation timed out!") (PURE)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def wait(work: Any, group: Any, timeout: timedelta | None, what: str, mine: str) -> None:
    """Wait for ``work``, at most ``timeout`` (None: the group's own timeout; pass None on
    NCCL, whose bounded wait would block the host); when it raises, raise
    :data:`NOT_MATCHED` naming where every rank is (``mine``: this rank's position, e.g.
    ``"in ShardedDataParallel's backward()"``)."""
    if timeout is None:
        work.wait()
        return
    try:
        work.wait(timeout)
    except RuntimeError as exc:
        text = NOT_MATCHED.format(
            what=what,
            error=first_line(exc),
            seconds=timeout.total_seconds(),
            where=where(group, mine, timeout),
        )
        raise RuntimeError(text) from exc


def _key(ranks: Sequence[int], rank: int) -> str:
    return f"oss_plus/where/{'-'.join(map(str, ranks))}/{rank}"


def grace(timeout: timedelta) -> float:
    """Seconds to wait for the others' positions: :data:`GRACE_S`, or half the arrival
    timeout when that is shorter (PURE).

    Example:
        >>> grace(timedelta(seconds=1)), grace(timedelta(seconds=60))
        (0.5, 5.0)
    """
    return min(GRACE_S, timeout.total_seconds() / 2)


def post(store: Any, ranks: Sequence[int], rank: int, where: str) -> None:
    """Post ``where`` (e.g. ``"in step() (its step 3)"``) as the position of global rank
    ``rank`` of the group of global ranks ``ranks``, stamped with the time (one store write)."""
    key = _key(ranks, rank)
    store.set(key, f"{time.time():.3f} {where}")
    _posted.add(key)


def clear(store: Any, ranks: Sequence[int], rank: int) -> None:
    """Withdraw the position of ``rank`` (a call completed), if this process posted one and
    did not clear it since (no store access otherwise)."""
    key = _key(ranks, rank)
    if key in _posted:
        store.set(key, "")
        _posted.discard(key)


def _read(store: Any, key: str, since: float) -> str | None:
    if not store.check([key]):
        return None
    stamp, _, where = bytes(store.get(key)).decode().partition(" ")
    return where if where and float(stamp) >= since else None


def report(
    store: Any, ranks: Sequence[int], rank: int, where: str, timeout: timedelta
) -> dict[int, str | None]:
    """Post ``where`` for ``rank``, then collect every other rank's position (posted within
    the last two timeouts), waiting at most :func:`grace` for the ones not posted yet.

    Returns:
        For each global rank of ``ranks`` but ``rank``: its position, or None (it did not
        post: it is in no collective call of oss_plus, or has left).
    """
    post(store, ranks, rank, where)
    since = time.time() - 2 * timeout.total_seconds() - GRACE_S
    deadline = time.monotonic() + grace(timeout)
    found: dict[int, str | None] = {r: None for r in ranks if r != rank}
    while True:
        for r in [r for r, w in found.items() if w is None]:
            found[r] = _read(store, _key(ranks, r), since)
        if all(found.values()) or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_S)


def describe(ranks: Sequence[int], found: Mapping[int, str | None], me: int) -> str:
    """Name every rank's position (PURE): ``found`` as :func:`report` returns it, ``me`` this
    rank's global rank."""
    parts = []
    for r in ranks:
        if r == me:
            parts.append(f"global rank {r} (this rank) is here")
            continue
        where = found.get(r)
        parts.append(f"global rank {r} is {where}" if where else f"global rank {r} {NOT_REPORTED}")
    return "; ".join(parts)
