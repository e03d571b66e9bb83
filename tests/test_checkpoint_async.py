"""Asynchronous checkpoints: ``save_checkpoint(..., blocking=False)``.

The checkpoint holds the state at the call while training (collectives on the optimizer's
group) runs during the write; a second save waits for the first; a failure on one rank is
every rank's future's exception and is raised again by the next save, the previous
checkpoint staying whole; a killed process leaves the previous checkpoint whole; a normal
exit finishes the save; staging memory is one shard and is reused.
"""

from __future__ import annotations

import copy
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import make_model, params_equal, train
from test_checkpoint import diff
from test_checkpoint_files import SCRIPT_HEAD

import oss_plus
from oss_plus import OSS, save_checkpoint
from oss_plus.checkpoint import PREVIOUS_SAVE_FAILED, read_state_dict, staging_nbytes, storage
from oss_plus.checkpoint.background import saver_of

REPO = Path(oss_plus.__file__).resolve().parent.parent
LAYOUTS = [True, False]
LAYOUT_IDS = ["sharded", "consolidated"]


def adam(group) -> tuple[torch.nn.Module, OSS]:
    model = make_model()
    return model, OSS(model.parameters(), optim=torch.optim.Adam, group=group, lr=0.01)


class Gate:
    """Holds every file open of a save until :meth:`open` (so the save stays in flight)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.original = storage.open_writer

    def __enter__(self) -> Gate:
        def gated(*args, **kwargs):
            assert self.event.wait(60), "gate never opened"
            return self.original(*args, **kwargs)

        storage.open_writer = gated
        return self

    def open(self) -> None:
        self.event.set()

    def __exit__(self, *exc) -> None:
        self.event.set()
        storage.open_writer = self.original


def in_flight_task(ctx, path: str, sharded: bool):
    """Save async, then train, reload a state and train on while the write waits."""
    model, opt = adam(ctx.group)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    train(model, opt, 2)
    train(reference, ref_opt, 2)
    at_call = copy.deepcopy(opt.state_dict(all_ranks=True))
    with Gate() as gate:
        future = save_checkpoint(opt, path, sharded=sharded, blocking=False)
        pending = not future.done()
        train(model, opt, 1, start=2)  # broadcasts on the training group, write in flight
        opt.load_state_dict(copy.deepcopy(opt.state_dict(all_ranks=True)))
        train(model, opt, 2, start=3)
        gate.open()
        result = future.result(timeout=60)
    train(reference, ref_opt, 3, start=2)
    return pending, result, diff(read_state_dict(path), at_call), params_equal(model, reference)


@pytest.mark.parametrize("sharded", LAYOUTS, ids=LAYOUT_IDS)
def test_the_checkpoint_holds_the_state_at_the_call_while_training_runs(pool, tmp_path, sharded):
    path = str(tmp_path / "c")
    for pending, result, problem, same in pool.run(in_flight_task, path, sharded, world_size=3):
        assert pending and result == path
        assert problem is None  # the state at the call, not the later one
        assert same  # training during the write equals the plain optimizer's, exactly


def failure_task(ctx, path: str, sharded: bool):
    model, opt = adam(ctx.group)
    train(model, opt, 1)
    save_checkpoint(opt, path, sharded=sharded)
    before = copy.deepcopy(opt.state_dict(all_ranks=True))
    train(model, opt, 1, start=1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    original = storage.open_writer
    if ctx.rank == 0:  # rank 0 opens a file in both layouts
        storage.open_writer = disk_full
    try:
        error = save_checkpoint(opt, path, sharded=sharded, blocking=False).exception(60)
    finally:
        storage.open_writer = original
    still = diff(read_state_dict(path), before)
    try:
        save_checkpoint(opt, path, sharded=sharded)
        again = None
    except RuntimeError as exc:
        again = str(exc)
    untouched = diff(read_state_dict(path), before)
    save_checkpoint(opt, path, sharded=sharded, blocking=False).result(60)
    recovered = diff(read_state_dict(path), opt.state_dict(all_ranks=True))
    return type(error).__name__, str(error), still, again, untouched, recovered


@pytest.mark.parametrize("sharded", LAYOUTS, ids=LAYOUT_IDS)
def test_a_failure_on_one_rank_fails_every_future_and_the_next_save(pool, tmp_path, sharded):
    path = str(tmp_path / "c")
    for rank, result in enumerate(pool.run(failure_task, path, sharded, world_size=2)):
        kind, message, still, again, untouched, recovered = result
        assert kind == "OSError" and "No space left" in message
        if rank > 0:
            assert "global rank(s) [0]" in message
        assert still is None and untouched is None  # the previous checkpoint, whole
        prefix = PREVIOUS_SAVE_FAILED.split("{path}")[0]
        assert again is not None and again.startswith(prefix) and "No space left" in again
        assert recovered is None


def serial_task(ctx, path: str):
    model, opt = adam(ctx.group)
    train(model, opt, 1)
    with Gate() as gate:
        first = save_checkpoint(opt, path, blocking=False)
        threading.Timer(0.5, gate.open).start()
        train(model, opt, 1, start=1)
        second = save_checkpoint(opt, path, sharded=False, blocking=False)
        first_done_before = first.done()
        second.result(60)
    return first_done_before, first.result(), diff(read_state_dict(path), opt.state_dict(True))


def test_a_second_save_waits_for_the_first(pool, tmp_path):
    for waited, first, problem in pool.run(serial_task, str(tmp_path / "c"), world_size=2):
        assert waited and first == str(tmp_path / "c") and problem is None


def staging_task(ctx, root: str):
    model, opt = adam(ctx.group)
    owned = 0
    sizes, pointers = set(), set()
    for step in range(50):
        train(model, opt, 1, start=step)
        save_checkpoint(opt, f"{root}/c", sharded=step % 2 == 0, blocking=False).result(60)
        sizes.add(staging_nbytes(opt))
        pointers.add(tuple(b.data_ptr() for b in saver_of(opt).staging.buffers().values()))
    local = opt.optim.state.values()
    owned = sum(v.numel() * v.element_size() for s in local for v in s.values() if v.dim())
    owned += sum(v.numel() * v.element_size() for s in local for v in s.values() if not v.dim())
    return sizes, len(pointers), owned, diff(read_state_dict(f"{root}/c"), opt.state_dict(True))


def test_staging_is_one_shard_allocated_once_over_50_saves(pool, tmp_path):
    for sizes, distinct, owned, problem in pool.run(staging_task, str(tmp_path), world_size=2):
        assert sizes == {owned} and owned > 0
        assert distinct == 1  # the same buffers every save
        assert problem is None


SCRIPT = (
    SCRIPT_HEAD
    + """
real = storage.commit
def slow_commit(*args, **kwargs):
    time.sleep(1.0)
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
storage.commit = slow_commit
save_checkpoint(opt, {path!r}, sharded={sharded}, blocking=False)
train(model, opt, 1, start=2)  # the script ends with the save in flight
"""
)


@pytest.mark.parametrize("sharded", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("kill", [True, False], ids=["killed", "exits"])
def test_a_process_ending_with_a_save_in_flight(tmp_path, kill, sharded):
    """Killed: the previous checkpoint stays whole. Exiting: the save finishes first."""
    root = tmp_path / "ckpt"
    tests = str(REPO / "tests")
    script = SCRIPT.format(repo=str(REPO), tests=tests, path=str(root), sharded=sharded, kill=kill)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    expected = -signal.SIGKILL if kill else 0
    assert done.returncode == expected, done.stderr.decode()[-2000:]
    assert time.monotonic() - began > 1.0
    steps = {float(s["step"]) for s in read_state_dict(root)["state"].values()}
    assert steps == ({1.0} if kill else {2.0})  # whole: the first save, or the second


def test_the_writer_thread_yields_the_cpu_to_training():
    """The background writer runs at WRITER_NICENESS; the training's threads keep theirs."""
    import os
    import threading

    from oss_plus.checkpoint import background

    if not hasattr(os, "setpriority"):
        pytest.skip("no per-thread priorities on this platform")
    seen: list[int] = []

    def writer() -> None:
        background._lower_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen == [max(before, background.WRITER_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


#: Two optimizer groups sharing global rank 2, in the order their saves run.
OVERLAPPING_GROUPS = ((0, 1, 2), (2, 3))


def overlapping_task(ctx, root: str):
    """Rank 2 is in both optimizer groups: it makes a checkpoint group for the first, so
    it knows one group more than rank 3 when both make one for the second."""
    problems = {}
    for ranks in OVERLAPPING_GROUPS:
        if ctx.global_rank not in ranks:
            continue
        model, opt = adam(ctx.groups[ranks])
        train(model, opt, 2)
        path = os.path.join(root, "_".join(map(str, ranks)))
        future = save_checkpoint(opt, path, blocking=False)
        assert future is not None and future.result(timeout=60) == path
        problems[ranks] = diff(read_state_dict(path), opt.state_dict(all_ranks=True))
    return problems


def test_asynchronous_saves_of_two_groups_sharing_a_rank(pool, tmp_path):
    """torch names a group made with use_local_synchronization=True after the number of
    groups each rank knows, so rank 2 and rank 3 would wait for each other under different
    names (until the checkpoint group's 10-minute timeout)."""
    results = pool.run(overlapping_task, str(tmp_path), world_size=4, timeout=60)
    for rank, problems in enumerate(results):
        assert problems == {r: None for r in OVERLAPPING_GROUPS if rank in r}
