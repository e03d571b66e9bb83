"""Read the whole optimizer state on the calling rank alone: the other ranks make no call.

``state_dict()`` called on one rank only, or on every rank with no consolidation first, and
``consolidate_state_dict(recipient_rank=r)`` on rank ``r`` (issue 56) read every other rank's
shard from that rank's server thread (:mod:`oss_plus.state.serve`): the result is the one the
collective consolidation gives (:func:`oss_plus.state.consolidate.whole_states`, stitched by
the same code), checked the same way (:mod:`oss_plus.state.agreement`), but only the caller
takes part.

* **One step.** Every shard comes with the step count it is at (read under the holder's step
  lock, :class:`Serving`); a shard at another step than the caller's is refused
  (:data:`STEPS_DIFFER`): without DDP a peer's local step runs before the step's sync, so a
  peer may have stepped on while the caller reads.
* **Bounded.** A peer that does not answer within the arrival timeout
  (:func:`oss_plus.runtime.arrival.arrival_timeout`) raises :data:`NO_ANSWER` on the caller.
* **Consolidation on every rank.** ``consolidate_state_dict(r)`` on the other ranks waits
  until ``r`` has read their shard at their step (:func:`wait_read`), so that none steps on
  before it is read; on ``r`` alone (mmengine's ZeRO class) nobody waits.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from oss_plus.runtime import positions
from oss_plus.runtime.arrival import arrival_timeout
from oss_plus.runtime.dist import error_class, group_members, name_rank, peer_failed
from oss_plus.state import serve
from oss_plus.state.agreement import as_built_on_rank_0, differing, raise_differing
from oss_plus.state.consolidate import assemble
from oss_plus.state.index import ParamState
from oss_plus.state.nested import unflatten_value
from oss_plus.state.serving import Serving, on_cpu, plan_print, snapshot

__all__ = [
    "NOT_READ",
    "NO_ANSWER",
    "NO_SERVICE",
    "REFUSED",
    "STEPS_DIFFER",
    "read_whole",
    "wait_read",
]

#: The default store cannot carry the reads (no other rank's shard can be read alone).
NO_SERVICE = (
    "{what} on this rank alone reads the other ranks' shards through the default process "
    "group's store, and here it cannot: {why}. Call consolidate_state_dict() on every rank "
    "first, or state_dict(all_ranks=True) on every rank"
)
#: A peer did not answer the read of its shard in time.
NO_ANSWER = (
    "{what} on this rank reads every rank's shard of the optimizer state; {rank} did not "
    "answer within {seconds:g}s (the arrival timeout, OSS_PLUS_ARRIVAL_TIMEOUT): its process "
    "is gone, or it built no such optimizer (every rank builds the same optimizers in the "
    "same order)"
)
#: A peer's shard is at another step than the caller's.
STEPS_DIFFER = (
    "{what} on this rank reads every rank's shard as of this rank's {mine}; {rank} holds "
    "its shard as of its {theirs}: it stepped on (or loaded a state) during the read "
    "(without DDP a rank's local step runs before the step's sync). Call it where no rank "
    "steps before it returns: with DDP, after a barrier, or call consolidate_state_dict() "
    "on every rank (the other ranks then wait until their shard is read)"
)
#: A peer refused the read for another reason.
REFUSED = "{what} on this rank could not read {rank}'s shard: {why}"
#: ``consolidate_state_dict(r)`` on a rank that ``r`` did not read in time.
NOT_READ = (
    "consolidate_state_dict(recipient_rank={recipient}) on this rank waits until {rank} has "
    "read this rank's shard of the optimizer state (this rank's step {steps}); it did not "
    "within {seconds:g}s (the arrival timeout, OSS_PLUS_ARRIVAL_TIMEOUT). Call it on rank "
    "{recipient} too, or on rank {recipient} alone. Where the ranks are: {where}"
)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a shard's metadata names an unknown dtype {name!r}")
    return dtype


def _receive(
    svc: serve.Service, reply: str, head: dict[str, Any], wait: Any
) -> dict[int, ParamState]:
    """The states of one peer's reply: allocate, then fill from its chunks in order."""
    states: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    targets: list[np.ndarray] = []
    for index, (skeleton, specs) in head["meta"].items():
        tensors = [torch.empty(shape, dtype=_dtype(d)) for d, shape in specs]
        states[int(index)] = (skeleton, tensors)
        targets += [t.view(-1).view(torch.uint8).numpy() for t in tensors if t.numel()]
    target, offset = 0, 0
    for j in range(int(head["chunks"])):
        data = wait(f"{reply}/c/{j}")
        with svc.talk_lock:
            svc.talk.set(f"{reply}/a/{j}", b"1")
        view = np.frombuffer(data, dtype=np.uint8)
        while len(view):
            room = len(targets[target]) - offset
            take = min(room, len(view))
            targets[target][offset : offset + take] = view[:take]
            view, offset = view[take:], offset + take
            if offset == len(targets[target]):
                target, offset = target + 1, 0
    return {
        i: unflatten_value(skeleton, tensors, f"state[{i}]")
        for i, (skeleton, tensors) in states.items()
    }


def read_whole(
    opt: Any, what: str, tell: bool = False
) -> tuple[dict[int, ParamState], dict[tuple[int, str], Any]]:
    """Every param's whole state (flat index -> state, tensors on CPU) read on this rank alone,
    and the values as built that rank 0 keeps (:func:`as_built_on_rank_0`).

    Raises:
        RuntimeError: :data:`NO_SERVICE`, :data:`NO_ANSWER`, :data:`STEPS_DIFFER` or
            :data:`REFUSED` (on this rank; with ``tell``, the ranks waiting in
            :func:`wait_read` raise it too).
        ValueError: the ranks hold different values where one state dict keeps one
            (:data:`oss_plus.state.agreement.RANKS_DIFFER`).
    """
    nonce = uuid.uuid4().hex
    try:
        got = _read_whole(opt, what, nonce, tell)
    except Exception as exc:
        if tell:
            _tell(opt, nonce, {"error": type(exc).__name__, "message": str(exc)})
        raise
    if tell:
        _tell(opt, nonce, {"error": None})
    return got


def _tell(opt: Any, nonce: str, outcome: dict[str, Any]) -> None:
    """Post how a read ended, for the ranks waiting in :func:`wait_read`."""
    found = serve.service()
    if isinstance(found, serve.Service):
        with found.talk_lock:
            found.talk.set(f"{serve.PREFIX}/reply/{nonce}/outcome", json.dumps(outcome))


def _read_whole(
    opt: Any, what: str, nonce: str, tell: bool
) -> tuple[dict[int, ParamState], dict[tuple[int, str], Any]]:
    serving: Serving = opt.shard_reads
    members, me, plan = group_members(opt.group), opt.rank, opt.plan
    timeout = arrival_timeout()
    seconds = timeout.total_seconds()
    found = serve.service() if len(members) > 1 else None
    if len(members) > 1 and (isinstance(found, str) or serving.uid is None):
        why = found if isinstance(found, str) else serving.why_not
        raise RuntimeError(NO_SERVICE.format(what=what, why=why))
    fingerprint = plan_print(plan)
    # this rank's own shard first, before any request is out: this rank's server may hold
    # the lock while it sends to a peer, and a peer waiting on a reply from this rank could
    # then wait on this rank's lock in turn (a cycle). With no lock taken once the requests
    # are out, and every reader reading its peers in the same (ascending) order, a server
    # blocked on a reader's acknowledgement waits on a reader at a peer no higher than
    # itself, which waits on a lower one in turn, or reads it: no cycle.
    with serving.lock:
        steps, version = serving.steps, serving.version
        serving.read_at = version
        mine, local = snapshot(opt)
        local = {i: on_cpu(s, i) for i, s in local.items()}
    peers = [r for r in range(len(members)) if r != me]
    for r in peers:
        assert isinstance(found, serve.Service)
        request = {
            "uid": serving.uid,
            "caller": members[me],
            "steps": steps,
            "version": version,
            "tell": tell,
            "plan": fingerprint,
            "reply": f"{serve.PREFIX}/reply/{nonce}/{r}",
            "outcome": f"{serve.PREFIX}/reply/{nonce}/outcome",
            "timeout": seconds,
        }
        found.post(members[r], request)
    per_rank: list[Any] = [None] * len(members)
    per_rank[me] = mine
    world = plan.world_size
    keyed = {i * world + me: s for i, s in local.items()}
    for r in peers:
        assert isinstance(found, serve.Service)
        svc, reply = found, f"{serve.PREFIX}/reply/{nonce}/{r}"

        def wait(key: str, rank: int = r, svc: serve.Service = svc) -> bytes:
            try:
                with svc.talk_lock:
                    svc.talk.wait([key], timeout)
                    data = svc.talk.get(key)
                    svc.talk.delete_key(key)
            except Exception:  # noqa: BLE001 - the store's timeout, told in our words
                name = name_rank(members, rank)
                raise RuntimeError(
                    NO_ANSWER.format(what=what, rank=name, seconds=seconds)
                ) from None
            return data

        head = json.loads(wait(f"{reply}/h"))
        _check_head(head, what, (members, r, me), version)
        per_rank[r] = head["digests"]
        keyed.update({i * world + r: s for i, s in _receive(svc, reply, head, wait).items()})
    names = differing(per_rank)
    if names:
        raise_differing(names, per_rank, opt.group, what)
    shapes = [p.shape for g in opt.param_groups for p in g["params"]]
    return assemble(keyed, plan, shapes), as_built_on_rank_0(per_rank)


def _as_of(version: Any) -> str:
    """``[steps, loads]`` in words."""
    steps, loads = version
    return f"step {steps}" + (f" (after {loads} load(s) of a state)" if loads else "")


def _check_head(
    head: Mapping[str, Any], what: str, who: tuple[list[int], int, int], version: list[int]
) -> None:
    """Raise what a peer's reply head says went wrong (nothing when it holds the shard)."""
    error = head.get("error")
    if error is None:
        return
    members, r, me = who
    rank = name_rank(members, r)
    if error == "raised":  # its shard cannot travel: its error, as agree() raises a peer's
        kind = str(head.get("kind"))
        raise error_class(kind)(
            f"{peer_failed(members, [r], me)}; global rank {members[r]} raised {kind}: "
            f"{head.get('message')}"
        )
    if error == "steps":
        raise RuntimeError(
            STEPS_DIFFER.format(
                what=what, mine=_as_of(version), rank=rank, theirs=_as_of(head.get("version"))
            )
        )
    why = {
        "gone": "it holds no such optimizer (collected, or not built there)",
        "plan": "its optimizer holds another partition (a repartition ran on some ranks only)",
    }.get(str(error), str(head.get("message", error)))
    raise RuntimeError(REFUSED.format(what=what, rank=rank, why=why))


def wait_read(opt: Any, recipient: int) -> None:
    """``consolidate_state_dict(recipient)`` on a rank other than ``recipient``: wait until
    ``recipient`` read this rank's shard at its step.

    Raises:
        RuntimeError: :data:`NOT_READ` after the arrival timeout.
    """
    serving: Serving = opt.shard_reads
    members, timeout = group_members(opt.group), arrival_timeout()
    steps = serving.steps
    outcome = serving.wait_read(members[recipient], steps, timeout.total_seconds())
    if outcome is None:
        mine = f"in consolidate_state_dict() after {steps} step(s)"  # as the arrival checks say
        where = positions.where(opt.group, mine, timeout)
        raise RuntimeError(
            NOT_READ.format(
                recipient=recipient,
                rank=name_rank(members, recipient),
                steps=steps,
                seconds=timeout.total_seconds(),
                where=where,
            )
        )
    found = serve.service()
    if not isinstance(found, serve.Service):
        return
    try:
        with found.talk_lock:
            found.talk.wait([outcome], timeout)
            told = json.loads(found.talk.get(outcome))
    except Exception:  # noqa: BLE001 - the recipient is gone after reading: it raised there
        told = {"error": "RuntimeError", "message": "it did not say how its read ended"}
    if told.get("error") is not None:
        kind = {"ValueError": ValueError, "TypeError": TypeError}.get(told["error"], RuntimeError)
        raise kind(told.get("message"))  # the recipient's own error, the same on every rank
