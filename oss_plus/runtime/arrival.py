"""Check that every rank of a group entered a collective call, before it communicates.

A collective call made on some ranks only (``consolidate_state_dict()`` from the saving rank
alone, as mmengine's ``CheckpointHook`` does; a clip or a checkpoint save inside an
``if rank == 0:``) would otherwise wait in its first collective for the process group's
timeout (30 minutes by default). Every collective entry point of oss_plus runs
:func:`entry` first: each caller registers on the default process group's key-value store
(out of band, nothing is sent on ``group``) and waits at most the arrival timeout for the
others. When they do not all come, every rank that came raises RuntimeError
(:data:`NOT_ALL_ARRIVED`, naming the call) instead of hanging; the ranks that never called
are not involved and go on (their next collective with the failed rank then fails as usual).

The API, for any collective entry point (``with`` around its body)::

    with _arrival.entry(group, "save_checkpoint()"):
        ...  # the collectives

:func:`entry` checks once per outermost call: an entry point that calls another on the same
group (``state_dict(all_ranks=True)`` consolidates) is checked once, under the outer name.
:func:`check_arrival` is the bare check (not skipped when nested).

With ``steps`` (the optimizer's :attr:`oss_plus.OSS.step_count`) the key holds the step count
too: ranks making the same call after different numbers of steps do not meet either, and
raise :data:`STEPS_DIFFER` naming every rank's count. A rank that waits posts where it is
(:mod:`oss_plus.runtime.positions`); a rank that gives up names where every rank is. The
step's own sync bounds its waits by the same timeout (:mod:`oss_plus.step.driver`).

The arrival timeout is :data:`ARRIVAL_TIMEOUT` (60 s), or the seconds in the environment
variable :data:`ARRIVAL_TIMEOUT_ENV`. A rank that legitimately arrives later than that (it
evaluated alone before a checkpoint) makes its peers raise: raise the timeout then.

Protocol, per group (its global ranks), per successful call ``n`` (every rank counts its own
successful calls; they agree because a call succeeds on all ranks or on none) and per name:
the callers add 1 to the counter of key ``n/what/attempt``; the one that completes it sets
the decision to ``go`` with compare-and-set; a caller that times out sets ``abort`` the same
way. Whichever comes first decides for everyone, so a late arrival and a timeout never
disagree. An aborted attempt is poisoned (its counter raised by :data:`_POISON`) and retired:
every rank that sees it (the callers then, the others at their next call of that name, whose
increment returns the poisoned count) moves to ``attempt + 1``, so the check can be used
again once the call sites are fixed. On the common path a rank makes 2 or 3 store round trips
(the increment, then the compare-and-set or the wait and the read) plus at most one delete:
the keys of call ``n - 1`` are deleted at call ``n`` (every rank has left it then), spread
over the ranks, so the store holds the keys of one call per group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oss_plus.runtime import positions
from oss_plus.runtime.dist import name_rank

__all__ = [
    "ARRIVAL_TIMEOUT",
    "ARRIVAL_TIMEOUT_ENV",
    "BAD_ARRIVAL_TIMEOUT",
    "NOT_ALL_ARRIVED",
    "STEPS_DIFFER",
    "arrival_timeout",
    "check_arrival",
    "entry",
]

logger = logging.getLogger(__name__)

#: How long a rank waits for the others to enter a collective call. Ranks reach a checkpoint
#: save or a clip at nearly the same time; a rank left alone raises after this delay.
ARRIVAL_TIMEOUT = timedelta(seconds=60)

#: Environment variable overriding :data:`ARRIVAL_TIMEOUT` (seconds, > 0).
ARRIVAL_TIMEOUT_ENV = "OSS_PLUS_ARRIVAL_TIMEOUT"

#: Raised when :data:`ARRIVAL_TIMEOUT_ENV` is not a positive number.
BAD_ARRIVAL_TIMEOUT = ARRIVAL_TIMEOUT_ENV + " must be a positive number of seconds, got {value!r}"

#: Raised on every rank that entered the call when some ranks of the group did not.
NOT_ALL_ARRIVED = (
    "{what} is collective but only {arrived} of the {world} ranks of the process group called "
    "it within {seconds:g}s (this is {rank}): call it on every rank of the group{hint}. A "
    "rank that comes later on purpose (it evaluated alone first) needs a longer "
    + ARRIVAL_TIMEOUT_ENV
)

#: Raised on every rank when every rank made the call, but after different numbers of
#: ``step()``: a rank skipped a step or made one twice.
STEPS_DIFFER = (
    "{what} was called on every rank of the process group, but after different numbers of "
    "step() ({where}): a rank skipped a step() or called it twice. Call step() on every "
    "rank alike (to skip a step on a non-finite loss, agree on it first: every rank skips "
    "or none does)"
)

#: Appended to :data:`NOT_ALL_ARRIVED`: where the other ranks are
#: (:func:`oss_plus.runtime.positions.describe`).
WHERE = ". Where the ranks are: {where}"

_GO, _ABORT = b"go", b"abort"
#: Added to the counter of an aborted attempt: a later increment returns at least this.
_POISON = 1 << 40


@dataclass
class _Group:
    """What a process counts for one group: successful calls, retired attempts per name
    (since the last success) and the last successful key (deleted at the next success)."""

    calls: int = 0
    attempts: dict[str, int] = field(default_factory=dict)
    last: str | None = None


#: Per group (its global ranks), for the default store of ``_state_store``.
_groups: dict[tuple[int, ...], _Group] = {}
#: The store the counts belong to, held weakly: a new default group (a new store) resets them.
#: Not its ``id()``: a destroyed group's store is freed and a new one can reuse its address,
#: on one rank and not on another, and the ranks' counts then name different keys.
_state_store: list[Callable[[], Any]] = [lambda: None]
_lock = threading.Lock()
_local = threading.local()  # .active: the groups this thread is inside an entry() of


#: The default process group's store (None where torch does not expose it).
_store = positions.default_store


def arrival_timeout() -> timedelta:
    """The arrival timeout now: :data:`ARRIVAL_TIMEOUT_ENV` when set, else
    :data:`ARRIVAL_TIMEOUT`.

    Raises:
        ValueError: the environment variable is not a positive number.
    """
    value = os.environ.get(ARRIVAL_TIMEOUT_ENV, "").strip()
    if not value:
        return ARRIVAL_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(BAD_ARRIVAL_TIMEOUT.format(value=value))
    return timedelta(seconds=seconds)


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _counts(store: Any, ranks: tuple[int, ...]) -> _Group:
    if _state_store[0]() is not store:  # a new default group: every rank starts again
        _groups.clear()
        _state_store[0] = _held_weakly(store)
    return _groups.setdefault(ranks, _Group())


def _held_weakly(store: Any) -> Callable[[], Any]:
    """A reference to ``store`` that does not keep it alive (torch holds the default group's
    store while the group lives); a strong one where the store takes no weak reference."""
    try:
        return weakref.ref(store)
    except TypeError:
        return lambda: store


def check_arrival(
    group: Any,
    what: str,
    timeout: timedelta | None = None,
    *,
    hint: str = "",
    steps: int | None = None,
) -> str | None:
    """Return once every rank of ``group`` called this with the same ``what`` (and the same
    ``steps``); else raise, naming where the other ranks are. Returns the store key every
    rank arrived at (the same on every rank, new at every call: an id of the call, e.g. of an
    optimizer built on every rank), or None where nothing was checked (world size 1, or no
    store exposed).

    Args:
        group: the process group (None: WORLD).
        what: names the call in keys and errors, e.g. ``"consolidate_state_dict()"``.
        timeout: how long to wait for the other ranks (default: :func:`arrival_timeout`).
        hint: appended to the error's advice (how the call is meant to be made).
        steps: the optimizer's :attr:`oss_plus.OSS.step_count`: every rank must have made
            as many steps (None: not compared).

    Raises:
        RuntimeError: some rank did not call within ``timeout`` (:data:`NOT_ALL_ARRIVED`
            with :data:`WHERE`), or every rank did after different numbers of steps
            (:data:`STEPS_DIFFER`); raised on every rank that called.

    .. warning:: Collective: call on every rank of ``group``.
    """
    store = _store()
    world = dist.get_world_size(group)
    if store is None or world == 1:
        return None
    timeout = arrival_timeout() if timeout is None else timeout
    ranks = _ranks(group)
    me = ranks[dist.get_rank(group)]
    where = f"in {what}" + ("" if steps is None else f" after {steps} step(s)")
    name = what if steps is None else f"{what}@{steps}"
    with _lock:
        counts = _counts(store, ranks)
    key, arrived = _arrive(store, ranks, counts, name, world, timeout, (me, where))
    if arrived is not None:
        found = positions.report(store, ranks, me, where, timeout)
        raise RuntimeError(_not_arrived(what, arrived, timeout, group, hint, found, where))
    last, counts.last = counts.last, key
    counts.calls += 1
    counts.attempts.clear()
    if last is not None:  # every rank has left the previous call: its keys go
        position = ranks.index(dist.get_rank())
        for i, suffix in enumerate(("count", "decision")):
            if i % world == position:
                store.delete_key(f"{last}/{suffix}")
    return key


def _arrive(
    store: Any,
    ranks: tuple[int, ...],
    counts: _Group,
    name: str,
    world: int,
    timeout: timedelta,
    mine: tuple[int, str],
) -> tuple[str, int | None]:
    """Register and wait; return the key and None (every rank came), or the number of ranks
    that came (the attempt is aborted and retired)."""
    prefix = f"oss_plus/arrival/{'-'.join(map(str, ranks))}"
    while True:
        attempt = counts.attempts.get(name, 0)
        key = f"{prefix}/{counts.calls}/{name}/{attempt}"
        arrived = store.add(f"{key}/count", 1)
        if arrived >= _POISON:  # aborted before this rank came: retired, try the next one
            counts.attempts[name] = attempt + 1
            continue
        if arrived == world:
            decision = store.compare_set(f"{key}/decision", "", _GO)
            break
        positions.post(store, ranks, *mine)  # where this rank waits, should it time out
        try:
            store.wait([f"{key}/decision"], timeout)
            decision = store.get(f"{key}/decision")
        except RuntimeError:  # DistStoreError: the others did not come in time
            decision = store.compare_set(f"{key}/decision", "", _ABORT)
        break
    if decision == _GO:
        positions.clear(store, ranks, mine[0])  # a position this rank posted is stale now
        return key, None
    arrived = store.add(f"{key}/count", _POISON) % _POISON  # retire it for the others
    counts.attempts[name] = attempt + 1
    return key, arrived


def _not_arrived(
    what: str,
    arrived: int,
    timeout: timedelta,
    group: Any,
    hint: str,
    found: dict[int, str | None],
    where: str,
) -> str:
    """The error of a call that did not complete: :data:`STEPS_DIFFER` when every rank is in
    the same call (``found``: the others' positions, ``where``: this rank's), else
    :data:`NOT_ALL_ARRIVED` with :data:`WHERE`."""
    ranks, rank = _ranks(group), dist.get_rank(group)
    same = f"in {what} after "
    if where.startswith(same) and all(w and w.startswith(same) for w in found.values()):
        steps = {r: w or "" for r, w in {**found, ranks[rank]: where}.items()}
        named = ", ".join(f"global rank {r} after {steps[r][len(same) :]}" for r in ranks)
        return STEPS_DIFFER.format(what=what, where=named)
    return NOT_ALL_ARRIVED.format(
        what=what,
        arrived=arrived,
        world=len(ranks),
        seconds=timeout.total_seconds(),
        rank=name_rank(ranks, rank),
        hint=hint,
    ) + WHERE.format(where=positions.describe(ranks, found, ranks[rank]))


@contextlib.contextmanager
def entry(
    group: Any,
    what: str,
    *,
    hint: str = "",
    timeout: timedelta | None = None,
    steps: int | None = None,
) -> Iterator[None]:
    """Run the block of a collective entry point once every rank of ``group`` entered it.

    :func:`check_arrival` first, unless this thread is already inside an :func:`entry` of
    the same group (an entry point called by another: checked once, as the outer one).

    Args:
        group: the process group the call communicates over (None: WORLD).
        what: names the call in the error, e.g. ``"save_checkpoint()"``.
        hint: appended to the error's advice.
        timeout: default :func:`arrival_timeout`.
        steps: the optimizer's step count, compared too (:func:`check_arrival`).

    Raises:
        RuntimeError: some rank did not enter within the timeout (:data:`NOT_ALL_ARRIVED`,
            on every rank that did), or entered after another number of steps
            (:data:`STEPS_DIFFER`).

    Example:
        >>> with entry(opt.group, "consolidate_state_dict()"):  # doctest: +SKIP
        ...     exchange()

    .. warning:: Collective: enter on every rank of ``group``.
    """
    active: set[tuple[int, ...]] | None = getattr(_local, "active", None)
    if active is None:
        active = _local.active = set()
    ranks = _ranks(group)
    if ranks in active:
        yield
        return
    check_arrival(group, what, timeout, hint=hint, steps=steps)
    active.add(ranks)
    try:
        yield
    finally:
        active.discard(ranks)
