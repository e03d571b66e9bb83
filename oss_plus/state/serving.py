"""What an optimizer owns for the reads of its shard by a rank that reads the whole state alone.

:class:`Serving` (``OSS.shard_reads``) holds the lock ``step()`` and ``import_local_state()``
hold around what changes the shard, the shard's version (``[steps, loads]``), a host copy
kept for the ranks still reading after this rank moved on, and the reads to consolidate it
served. :func:`answer` is what this rank's server thread (:mod:`oss_plus.state.serve`) runs
for a read request: the shard as of the caller's version, or why not. The reading side is
:mod:`oss_plus.state.pull`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from typing import Any

import torch

from oss_plus.planning.plan import ShardPlan
from oss_plus.state import serve
from oss_plus.state.agreement import digests
from oss_plus.state.consolidate import CPU
from oss_plus.state.index import ParamState
from oss_plus.state.nested import flatten_param_state, unflatten_value

__all__ = ["Serving", "answer", "on_cpu", "plan_print", "snapshot"]


class Serving:
    """What an optimizer owns for the reads of its shard: the step lock (``step()`` holds it
    around its local step only), the step count the shard is at, the reads served."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Notified under :attr:`lock` when the version moves on (a read waits for a slower
        #: rank to reach the caller's version).
        self.changed = threading.Condition(self.lock)
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
        self.kept = (self.version, mine, {i: on_cpu(s, i, copy=True) for i, s in local.items()})

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
    pieces = sorted((i, p.owner, p.start, p.end) for i, ps in plan.by_index.items() for p in ps)
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
            wanted = request.get("version") or [0, 0]
            if serving.version < wanted:  # this rank is behind: it may catch up (a load)
                wait = 0.8 * float(request.get("timeout", 60.0))
                serving.changed.wait_for(lambda: serving.version >= wanted, wait)
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


def on_cpu(state: ParamState, index: int, copy: bool = False) -> ParamState:
    """``state`` with its tensors on the host (copies with ``copy``, else where needed)."""
    skeleton, tensors = flatten_param_state(state, f"state[{index}]")
    moved = [t.to(CPU, copy=copy) for t in tensors]
    return unflatten_value(skeleton, moved, f"state[{index}]")
