"""Every process of a full training lifecycle exits 0: no abort at interpreter exit.

20 fresh 2-rank runs of tests/lifecycle.py (``init_process_group``, ``OSS`` under
``ShardedDataParallel``, a second ``OSS`` stepped in DDP's comm hook, a blocking and an
asynchronous ``save_checkpoint``, ``destroy_process_group()``, exit), each rank its own
interpreter, and fairscale's pattern (``mp.spawn``, a file store, ``OSS`` + SDP) a few times.
A rank that aborts (SIGABRT, "terminate called without an active exception"), dies on a
signal or exits non-zero fails the test with its stderr; nothing is rerun.
"""

from __future__ import annotations

import os
import time

import lifecycle
import pytest
from helpers import ROOT

RUNS = 20
SPAWN_RUNS = 2


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


def test_fairscales_spawn_pattern_exits_0():
    failures = []
    for run in range(SPAWN_RUNS):
        outcomes = lifecycle.spawn_run(2, {"overlap", "ckpt", "async"})
        failures += [f"run {run}: {o}" for o in outcomes if o != "ok"]
    assert not failures, "\n".join(failures)
