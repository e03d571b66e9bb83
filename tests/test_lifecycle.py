"""Every process of a full training lifecycle exits 0: no abort at interpreter exit.

20 fresh 2-rank runs of tests/lifecycle.py (``init_process_group``, ``OSS`` under
``ShardedDataParallel``, a second ``OSS`` stepped in DDP's comm hook, a blocking and an
asynchronous ``save_checkpoint``, ``destroy_process_group()``, exit), each rank its own
interpreter, fairscale's pattern (``mp.spawn``, a file store, ``OSS`` + SDP) a few times, and
10 runs of the ZeRO-2-only script that exits right after a ``backward()`` with no step.
A rank that aborts (SIGABRT, "terminate called without an active exception"), dies on a
signal or exits non-zero fails the test with its stderr; nothing is rerun.
"""

from __future__ import annotations

import os
import time

import lifecycle
import pytest
import torch
from helpers import ROOT, backward, counts_while_holding_the_gil, make_model

from oss_plus import OSS

RUNS = 20
SPAWN_RUNS = 2
SDP_RUNS = 10


@pytest.fixture(autouse=True)
def _worktree_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_every_rank_of_every_lifecycle_exits_0():
    start, failures = time.perf_counter(), []
    for run in range(RUNS):
        outcomes = lifecycle.one_run(2, set(), timeout=120, cores=None)
        failures += [f"run {run} rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failures, "\n".join(failures)
    print(f"{RUNS} lifecycles in {time.perf_counter() - start:.0f}s")


def test_zero2_exiting_right_after_backward_exits_0():
    """ShardedDataParallel + OSS, then a last forward and backward with no step, then exit:
    the reducer's collectives (buckets and used flags) are the last ones of the process."""
    failures = []
    for run in range(SDP_RUNS):
        outcomes = lifecycle.one_run(2, {lifecycle.SDP_BACKWARD}, timeout=120, cores=None)
        failures += [f"run {run} rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failures, "\n".join(failures)


def test_fairscales_spawn_pattern_exits_0():
    failures = []
    for run in range(SPAWN_RUNS):
        outcomes = lifecycle.spawn_run(2, {"overlap", "ckpt", "async"})
        failures += [f"run {run}: {o}" for o in outcomes if o != "ok"]
    assert not failures, "\n".join(failures)


def released_task(ctx) -> tuple[list[int], list[list[int]]]:
    """The C++ use counts of the sync's buckets before 20 steps and right after each.

    With a 1 s switch interval this thread keeps the GIL after the last ``wait()``, so a gloo
    worker that still has to drop its reference (which takes the GIL) cannot do it before the
    counts are read, unless ``OSS.step`` yielded until it did (``_dist.await_release``).
    Without that wait the counts stay raised (checked by making it a no-op).
    """
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, broadcast_dtype=torch.bfloat16)
    backward(model, 0)
    opt.step()  # the wire buffers exist from here on
    tensors = [b.flat for b in opt.sync.buckets if b.flat is not None]
    tensors += [b.wire_buffer(torch.bfloat16) for b in opt.sync.buckets if b.flat is not None]

    def step(k: int) -> None:
        backward(model, k)
        opt.step()

    return counts_while_holding_the_gil(tensors, step, 20)


def test_a_step_returns_after_gloo_dropped_its_tensors(pool):
    """The cause of the abort at exit (issue 21): a gloo worker dropping its reference after
    ``step()`` returned takes the GIL; during interpreter finalization that kills the thread
    and aborts the process."""
    for before, after in pool.run(released_task, world_size=2, timeout=60):
        assert after == [before] * len(after)
