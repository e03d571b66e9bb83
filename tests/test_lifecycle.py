"""Every process of a full training lifecycle exits 0: no abort at interpreter exit.

20 fresh 2-rank runs (4 in the default suite; ``FULL`` below) of tests/lifecycle.py
(``init_process_group``, ``OSS`` under ``ShardedDataParallel``, a second ``OSS`` stepped in
DDP's comm hook, a blocking and an asynchronous ``save_checkpoint``,
``destroy_process_group()``, exit), each rank its own interpreter, fairscale's pattern
(``mp.spawn``, a file store, ``OSS`` + SDP) a few times, and 10 runs (2) of the ZeRO-2-only
script that exits right after a ``backward()`` with no step. A rank that aborts (SIGABRT,
"terminate called without an active exception"), dies on a signal or exits non-zero fails
the test with its stderr; nothing is rerun.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import lifecycle
import pytest
import torch
import torch.distributed as dist
from helpers import (
    ROOT,
    backward,
    collective_tensors,
    counts_while_holding_the_gil,
    ddp_of,
    make_model,
    make_overlap_model,
    overlap_loss,
    still_held,
)

from oss_plus import OSS
from oss_plus.checkpoint import comm
from oss_plus.compat.ddp_zero_hook import hook_with_zero_step
from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.overlap import ddp_reduce_hook, overlap_hook

#: The full counts: ``tox -e lifecycle`` (``OSS_PLUS_LIFECYCLE=full``). The abort these tests
#: guard against hit 7 of 50 runs before its fix (about one run in 7), so 20 runs miss it
#: with probability 0.05; the default suite (CI's 20-minute budget) runs every scenario a
#: few times, a smoke check that would miss it about half the time.
FULL = os.environ.get("OSS_PLUS_LIFECYCLE") == "full"
RUNS = 20 if FULL else 4
SPAWN_RUNS = 2 if FULL else 1
SDP_RUNS = 10 if FULL else 2
TORCH_LAST_RUNS = 8 if FULL else 2
INSTALL_ONLY_RUNS = 6 if FULL else 2


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
    assert_every_run_exits_0(lifecycle.SDP_BACKWARD, SDP_RUNS)


def assert_every_run_exits_0(script: str, runs: int) -> None:
    """``runs`` fresh 2-rank runs of ``tests/lifecycle.py``'s ``script``: every rank exits 0."""
    failures = []
    for run in range(runs):
        outcomes = lifecycle.one_run(2, {script}, timeout=120, cores=None)
        failures += [f"run {run} rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failures, "\n".join(failures)


def test_exiting_right_after_torchs_own_collectives_exits_0(monkeypatch):
    """oss_plus used, then the script's own ``dist.all_gather`` calls last (fairscale's test
    suites end so) and exit: oss_plus cannot wait for those, its exit handler
    (``oss_plus.runtime.exit``) lets gloo's workers drop them before the interpreter finalizes.
    A 1 s switch interval keeps the GIL from the worker until then: without the handler 6 of 10
    such runs aborted (``tests/lifecycle.py --torch-last``, 0 of 10 with it), so 8 runs
    that all pass miss a missing handler with probability about 1 in 100."""
    monkeypatch.setenv("LIFECYCLE_SWITCH_S", "1.0")
    assert_every_run_exits_0(lifecycle.TORCH_LAST, TORCH_LAST_RUNS)


def test_a_process_that_only_installs_the_adapter_exits_0(monkeypatch):
    """``oss_plus.compat.fairscale.install()``, then plain DDP + Adam and exit, no ``OSS``
    (the DDP reference run of a Lightning 1.9 script that installs the adapter; issue 36):
    ``install()`` registers the exit handler. 1 s switch interval: 13 of 119 runs aborted
    when nothing registered it (a gloo worker destroying DDP's finished all-reduce during
    ``finalize_modules``), 0 of 60 with it; 6 passing runs miss a missing handler with
    probability about 0.55."""
    monkeypatch.setenv("LIFECYCLE_SWITCH_S", "1.0")
    assert_every_run_exits_0(lifecycle.INSTALL_ONLY, INSTALL_ONLY_RUNS)


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


#: Overlapped iterations probed per rank: without the wait, 4 to 21 % of them found a tensor
#: still held (200 per rank and schedule, measured with the wait made a no-op).
ITERATIONS = 100


def overlapped(ctx, kind: str) -> tuple[torch.nn.Module, Any, Any]:
    """DDP, an optimizer and the comm hook stepping it, reduced by :func:`ddp_reduce_hook`:
    the core's overlap (``step`` or ``interleaved`` schedule) or the torch adapter's, whose
    first two iterations only reduce (torch's warm-up). The hook is not registered yet."""
    ddp = ddp_of(ctx, make_overlap_model())
    if kind == "torch_adapter":
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.Adam, process_group=ctx.group, overlap_with_ddp=True
        )
        return ddp, zero, hook_with_zero_step(ddp_reduce_hook, ddp, zero)
    opt = OSS(
        ddp.parameters(),
        optim=torch.optim.Adam,
        group=ctx.group,
        lr=0.01,
        broadcast_dtype=torch.bfloat16,
    )
    return ddp, opt, overlap_hook(ddp_reduce_hook, ddp, opt, interleaved=kind == "interleaved")


def overlap_released_task(ctx, kind: str) -> list[list[tuple[str, int, int]]]:
    """Per iteration, the tensors given to torch.distributed during an overlapped backward
    (the reduction hook's all-reduces, the pieces' broadcasts) that gloo's worker still
    holds right after the hook of the last DDP bucket returned (1 s switch interval, as
    above; read in a hook around the overlap's, before DDP and autograd finish backward
    without the GIL, which would give the worker time).

    Each such work holds the thread-local state of ``backward()``, which references a Python
    object (autograd's stashed context), so the worker takes the GIL when it drops the
    work: after an exit right after ``backward()`` that aborted 10 of 85 lifecycles.
    """
    ddp, opt, overlap = overlapped(ctx, kind)
    held: list[list[tuple[str, int, int]]] = []
    seen: list[tuple[str, torch.Tensor, int]] = []

    def probing(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = overlap(state, bucket)
        if bucket.is_last():
            held.append(still_held(seen))
        return fut

    probing.__annotations__ = overlap.__annotations__  # DDP checks the hook's annotations
    ddp.register_comm_hook(None, probing)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        for it in range(ITERATIONS):
            with collective_tensors() as seen:
                opt.zero_grad()
                overlap_loss(ddp, it, ctx.rank).backward()
    finally:
        sys.setswitchinterval(interval)
    return held


@pytest.mark.parametrize("kind", ["step", "interleaved", "torch_adapter"])
def test_an_overlapped_backward_returns_after_gloo_dropped_its_tensors(pool, kind):
    for held in pool.run(overlap_released_task, kind, world_size=2, timeout=60):
        assert len(held) == ITERATIONS
        assert held == [[]] * len(held)


def checkpoint_comm_task(ctx) -> dict[str, int]:
    """Per collective of a save (the checkpoint's metadata gather, barrier and broadcast, the
    stream of tensors to rank 0), in how many of :data:`ITERATIONS` calls gloo's worker still
    held a tensor right after the call returned (1 s switch interval, as above)."""
    tensors = [torch.arange(n, dtype=torch.float32) for n in (3, 300, 5)]
    items = [
        (r, t if r == 0 else None, t.numel() * t.element_size())
        for r in range(ctx.world_size)
        for t in tensors
    ]
    text = "ab" if ctx.rank == 0 else None
    calls = {
        "gather_json": lambda: comm.gather_json({"rank": ctx.rank}, ctx.group),
        "barrier": lambda: comm.barrier(ctx.group),
        "broadcast_text": lambda: comm.broadcast_text(text, 2, ctx.group),
        "stream": lambda: (
            comm.receive_to_file(items, None, 0, ctx.group)
            if ctx.rank == 0
            else comm.send_tensors(tensors, ctx.group)
        ),
    }
    held = dict.fromkeys(calls, 0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        for _ in range(ITERATIONS):
            for name, call in calls.items():
                with collective_tensors() as seen:
                    call()
                    held[name] += bool(still_held(seen))
    finally:
        sys.setswitchinterval(interval)
    return held


def test_the_checkpoint_collectives_return_after_gloo_dropped_their_tensors(pool):
    for held in pool.run(checkpoint_comm_task, world_size=2, timeout=60):
        assert held == dict.fromkeys(held, 0)
