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

import hashlib
import json
import threading
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from oss_plus.planning.plan import ShardPlan
from oss_plus.runtime import positions
from oss_plus.runtime.arrival import arrival_timeout
from oss_plus.runtime.dist import error_class, group_members, name_rank, peer_failed
from oss_plus.state import serve
from oss_plus.state.agreement import as_built_on_rank_0, differing, digests, raise_differing
from oss_plus.state.consolidate import CPU, assemble
from oss_plus.state.index import ParamState
from oss_plus.state.nested import flatten_param_state, unflatten_value

__all__ = ["NO_ANSWER", "NOT_READ", "NO_SERVICE", "STEPS_DIFFER", "Serving", "read_whole"]

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
    "its shard as of its {theirs}: it stepped on (or loaded a state) during the read (without "
    "DDP a rank's local step runs before the step's sync) or is behind. Call it where no rank steps "
    "before it returns: with DDP, after a barrier, or call consolidate_state_dict() on "
    "every rank (the other ranks then wait until their shard is read)"
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


class Serving:
    """What an optimizer owns for the reads of its shard: the step lock (``step()`` holds it
    around its local step only), the step count the shard is at, the reads served."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: The step count this rank's shard is at (set under :attr:`lock` by ``step()``).
        self.steps = 0
        #: The loads of a state into this shard (``load_state_dict``, checkpoints), counted
        #: under :attr:`lock`: a shard is read as of (steps, loads).
        self.loads = 0
        #: The optimizer's id in its group's service (None: not served; :attr:`why_not`).
        self.uid: str | None = None
        self.why_not = "the optimizer is not served"
        #: The step at which this rank last read the whole state (state_dict() on every rank:
        #: its next step keeps its shard as read, for the peers still reading it).
        self.read_at: list[int] | None = None
        #: (version, digests, states) kept by :meth:`keep`, or None.
        self.kept: tuple[list[int], dict[str, Any], dict[int, ParamState]] | None = None
        #: Set once the optimizer is built (a peer may read as soon as its own is).
        self.ready = threading.Event()
        self._reads: dict[tuple[int, int], list[str]] = {}
        self._expected: Counter[tuple[int, int]] = Counter()
        self._read = threading.Condition()

    def start(self, uid: str | None, answer: serve.Answer) -> None:
        """Serve ``answer`` under ``uid`` (the same on every rank of the group; None at world
        size 1 or without a store) on this process's service (not collective; ``why_not``
        says why not when the store cannot carry reads)."""
        if uid is None:
            self.why_not = "torch does not expose the default process group's store"
            return
        found = serve.service()
        if isinstance(found, str):
            self.why_not = found
        else:
            found.register(uid, answer)
            self.uid = uid

    @property
    def version(self) -> list[int]:
        """[steps, loads]: what this shard is as of (the same on every rank in step)."""
        return [self.steps, self.loads]

    def keep(self, opt: Any) -> None:
        """Called by ``step()`` under :attr:`lock`, before its local step: when this rank read
        the whole state at this step, keep a host copy of its shard as it is, to serve the
        peers that read it too but later (``state_dict()`` on every rank without DDP: this
        rank's local step runs before the sync waits for them); else drop what was kept.
        Nothing is read or copied in a step that follows no read. ``import_local_state``
        calls it too, before a load."""
        if self.read_at != self.version:  # kept until a later step: its readers are done
            if self.kept is not None and self.kept[0][0] < self.steps:
                self.kept = None
            return
        mine, local = snapshot(opt)
        self.kept = (self.version, mine, {i: _on_cpu(s, i, copy=True) for i, s in local.items()})

    def record(self, caller: int, steps: int, outcome: str) -> None:
        """Global rank ``caller`` read this shard at ``steps`` to consolidate it (it posts
        how the read ended under ``outcome``)."""
        with self._read:
            self._reads.setdefault((caller, steps), []).append(outcome)
            for key in [k for k in self._reads if k[1] < steps - 1]:
                del self._reads[key]
            self._read.notify_all()

    def wait_read(self, caller: int, steps: int, seconds: float) -> str | None:
        """Wait until ``caller`` read this shard at ``steps`` once more than it was awaited
        before; return that read's reply prefix (None after ``seconds``)."""
        with self._read:
            self._expected[(caller, steps)] += 1
            want = self._expected[(caller, steps)]
            if not self._read.wait_for(
                lambda: len(self._reads.get((caller, steps), ())) >= want, seconds
            ):
                return None
            return self._reads[(caller, steps)][want - 1]


def plan_print(plan: ShardPlan) -> str:
    """A fingerprint of ``plan``: who holds which elements of which param."""
    pieces = sorted(
        (i, p.owner, p.start, p.end) for i, ps in plan.by_index.items() for p in ps
    )
    text = json.dumps([plan.world_size, plan.num_params, pieces])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def snapshot(opt: Any) -> tuple[dict[str, Any], dict[int, ParamState]]:
    """This rank's digests (:func:`oss_plus.state.agreement.digests`) and local states: call
    under ``opt``'s step lock.

    The digests are those of the inner optimizer's groups, which change only in a step (the
    optimizer's own groups change between steps, at different times on different ranks: a
    scheduler built on one rank before the other; at the same step count the inner groups
    differ only by what the inner optimizer keeps per rank, which is what is checked)."""
    shard = opt.local_shard
    mine = digests(shard.extras(), shard.optim.param_groups, shard.built_groups)
    return json.loads(json.dumps(mine)), opt.export_local_state()


def answer(opt: Any, request: dict[str, Any], send: serve.Send) -> None:
    """Serve ``opt``'s shard to the read ``request`` (on the server thread). A read to
    consolidate is recorded however it ends: the caller tells this rank how (:func:`wait_read`)."""
    serving: Serving = opt.shard_reads
    try:
        if not serving.ready.wait(float(request.get("timeout", 60.0))):
            send({"error": "gone"}, [])
            return
        with serving.lock:
            _answer_locked(opt, serving, request, send)
    finally:
        if request.get("tell"):
            serving.record(int(request["caller"]), int(request["steps"]), str(request["outcome"]))


def _answer_locked(opt: Any, serving: Serving, request: dict[str, Any], send: serve.Send) -> None:
    if request.get("plan") != plan_print(opt.plan):
        send({"error": "plan"}, [])
        return
    kept, wanted = serving.kept, request.get("version")
    if kept is not None and kept[0] == wanted != serving.version:
        mine, local = kept[1], kept[2]  # as this rank read it, before it moved on
    elif serving.version != wanted:
        send({"error": "steps", "version": serving.version}, [])
        return
    else:
        mine, local = snapshot(opt)
    meta: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    for index in sorted(local):
        skeleton, values = flatten_param_state(local[index], f"state[{index}]")
        meta[str(index)] = [skeleton, [[str(t.dtype)[6:], list(t.shape)] for t in values]]
        tensors += values
    send({"error": None, "digests": mine, "meta": meta}, tensors)


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
    steps, version, fingerprint = serving.steps, serving.version, plan_print(plan)
    serving.read_at = version
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
    with serving.lock:
        mine, local = snapshot(opt)
        local = {i: _on_cpu(s, i) for i, s in local.items()}
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
            return bytes(data)

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


def _on_cpu(state: ParamState, index: int, copy: bool = False) -> ParamState:
    """``state`` with its tensors on the host (copies with ``copy``, else where needed)."""
    skeleton, tensors = flatten_param_state(state, f"state[{index}]")
    moved = [t.to(CPU, copy=copy) for t in tensors]
    return unflatten_value(skeleton, moved, f"state[{index}]")


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
