"""Check that every rank of a group entered a collective call, before it communicates.

Frameworks call ``optimizer.state_dict()`` either on every rank (Accelerate, Ignite) or on
the saving rank only (the Hugging Face Trainer). Under ``collective_state_dict=True`` the call
is collective, so a rank that enters it alone would wait forever in its first send or recv.
:func:`check_arrival` runs first: every caller registers on the default process group's
key-value store (out of band, nothing is sent on ``group``) and waits at most
:data:`ARRIVAL_TIMEOUT` for the others. When they do not all come, every rank that came raises
RuntimeError (:data:`NOT_ALL_ARRIVED`) instead of hanging; the ranks that never called are not
involved and go on (their next collective with the failed rank then fails as usual).

Protocol, per group and per successful call ``n`` (every rank counts its own calls; they
agree because a call succeeds on all ranks or on none): each caller adds 1 to a counter; the
one that completes it sets the decision key to ``go`` with compare-and-set; a caller that
times out sets it to ``abort`` the same way. Whichever comes first decides for everyone, so
a late arrival and a timeout never disagree. An aborted attempt is retired (the next call
uses a fresh key), so the check can be used again once the call sites are fixed.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["ARRIVAL_TIMEOUT", "NOT_ALL_ARRIVED", "check_arrival"]

logger = logging.getLogger(__name__)

#: How long a rank waits for the others to enter a collective ``state_dict()``. Ranks reach
#: a checkpoint save at nearly the same time; a rank left alone raises after this delay.
ARRIVAL_TIMEOUT = timedelta(seconds=60)

#: Raised on every rank that entered the call when some ranks of the group did not.
NOT_ALL_ARRIVED = (
    "{what} is collective (collective_state_dict=True) but only {arrived} of the {world} "
    "ranks of the process group called it within {seconds:g}s (this is rank {rank}): call it "
    "on every rank, or call consolidate_state_dict() on every rank first and then "
    "state_dict() on the saving rank only (see docs/integrations.md)"
)

_GO, _ABORT = b"go", b"abort"
#: Successful calls so far, per group (its global ranks).
_calls: dict[tuple[int, ...], int] = {}


def _store() -> Any | None:
    """Return the default process group's store (None where torch does not expose it)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def check_arrival(group: Any, what: str, timeout: timedelta | None = None) -> None:
    """Return once every rank of ``group`` called this with the same ``what``; else raise.

    Args:
        group: the process group (None: WORLD).
        what: names the call in keys and errors, e.g. ``"OSS.state_dict()"``.
        timeout: how long to wait for the other ranks (default :data:`ARRIVAL_TIMEOUT`).

    Raises:
        RuntimeError: some rank did not call within ``timeout`` (raised on every rank that
            did).

    .. warning:: Collective: call on every rank of ``group``.
    """
    store = _store()
    world = dist.get_world_size(group)
    if store is None or world == 1:
        return
    timeout = ARRIVAL_TIMEOUT if timeout is None else timeout
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    calls = _calls.get(ranks, 0)
    base = f"oss_plus/arrival/{what}/{'-'.join(map(str, ranks))}/{calls}"
    key = f"{base}/{store.add(f'{base}/attempt', 0)}"
    arrived = store.add(f"{key}/count", 1)
    if arrived == world:
        decision = store.compare_set(f"{key}/decision", "", _GO)
    else:
        try:
            store.wait([f"{key}/decision"], timeout)
            decision = store.get(f"{key}/decision")
        except RuntimeError:  # DistStoreError: the others did not come in time
            decision = store.compare_set(f"{key}/decision", "", _ABORT)
            if decision == _ABORT and store.add(f"{key}/retired", 1) == 1:
                store.add(f"{base}/attempt", 1)
    if decision != _GO:
        rank = dist.get_rank(group)
        arrived = store.add(f"{key}/count", 0)
        raise RuntimeError(
            NOT_ALL_ARRIVED.format(
                what=what,
                arrived=arrived,
                world=world,
                seconds=timeout.total_seconds(),
                rank=rank,
            )
        )
    _calls[ranks] = calls + 1
