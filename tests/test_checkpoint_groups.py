"""Saves from disjoint process groups to one path: exactly one complete checkpoint survives.

Two optimizers on disjoint subgroups (ranks 0-1 and 2-3, e.g. the node groups of hybrid
ZeRO-1 built by hand) that save the same state to the same directory each commit their own
save. Before the commit lock, each commit then removed every data file that was not its own,
so the surviving ``index.json`` could name files the other group had deleted. The race is made
deterministic here: both coordinators meet after their commit (a barrier on files, since no
process group spans exactly them), so both commits happen before either removal.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from helpers import catch
from test_checkpoint import diff, trained_oss

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint import read_state_dict, storage


def file_barrier(where: Path, name: str, parties: int, timeout: float = 30.0) -> None:
    """Wait until ``parties`` processes touched ``where`` (a directory of marker files)."""
    mark(where, name)
    wait_for(where, name, parties, timeout)


def mark(where: Path, name: str) -> None:
    """Leave the marker ``name`` of this process in ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}-{os.getpid()}").touch()


def wait_for(where: Path, name: str, parties: int = 1, timeout: float = 30.0) -> None:
    """Wait until ``parties`` processes left the marker ``name`` in ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    while len([p for p in where.iterdir() if p.name.startswith(name)]) < parties:
        assert time.monotonic() < deadline, f"file barrier {name} timed out"
        time.sleep(0.01)


def two_groups_task(ctx, root: str, meet: str, sharded: bool, blocking: bool):
    node = ctx.groups[(0, 1)] if ctx.global_rank < 2 else ctx.groups[(2, 3)]
    _, opt = trained_oss("plain", "Adam", node)  # the same state in both groups
    original = storage.commit

    def commit_then_meet(*args, **kwargs):
        result = original(*args, **kwargs)
        file_barrier(Path(meet), "committed", parties=2)  # both committed, none removed yet
        return result

    storage.commit = commit_then_meet
    try:
        future = save_checkpoint(opt, root, sharded=sharded, blocking=blocking)
        if future is not None:
            future.result(timeout=60)
    finally:
        storage.commit = original
    torch.distributed.barrier(group=ctx.group)  # every removal done on every rank
    return diff(read_state_dict(root), opt.state_dict(all_ranks=True))


def load_task(ctx, root: str):
    _, opt = trained_oss("plain", "Adam", ctx.group)
    expected = opt.state_dict(all_ranks=True)
    fresh = OSS(trained_oss("plain", "Adam", ctx.group)[0].parameters(), optim=torch.optim.Adam)
    load_checkpoint(fresh, root)
    return diff(fresh.state_dict(all_ranks=True), expected)


CASES = [(True, True), (False, True), (True, False)]


@pytest.mark.parametrize(
    ("sharded", "blocking"), CASES, ids=["sharded", "consolidated", "sharded-async"]
)
def test_disjoint_groups_saving_to_one_path_leave_one_complete_checkpoint(
    pool, tmp_path, sharded, blocking
):
    root = str(tmp_path / "c")
    results = pool.run(
        two_groups_task, root, str(tmp_path / "meet"), sharded, blocking, world_size=4
    )
    assert results == [None] * 4  # the surviving checkpoint is complete and holds the state
    assert pool.run(load_task, root, world_size=4) == [None] * 4  # and loads at another size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "meet"]  # no stage left behind


def sweep_task(ctx, root: str, meet: str):
    """Group (2, 3) starts its save while group (0, 1)'s is in flight: its stale-sibling sweep
    runs after rank 0 wrote its file into the stage and before that stage is committed."""
    node = ctx.groups[(0, 1)] if ctx.global_rank < 2 else ctx.groups[(2, 3)]
    _, opt = trained_oss("plain", "Adam", node)
    saved = storage.write_file, storage.prepare_stage, storage.commit
    where = Path(meet)

    def write_then_mark(*args, **kwargs):
        result = saved[0](*args, **kwargs)
        mark(where, "written")  # rank 0's file is in its stage
        return result

    def prepare_after_written(*args, **kwargs):
        wait_for(where, "written")  # group (0, 1)'s save is in flight
        result = saved[1](*args, **kwargs)  # sweeps stale siblings
        mark(where, "swept")
        return result

    def commit_after_sweep(*args, **kwargs):
        wait_for(where, "swept")  # the other group's sweep ran
        return saved[2](*args, **kwargs)

    if ctx.global_rank == 0:
        storage.write_file, storage.commit = write_then_mark, commit_after_sweep
    elif ctx.global_rank == 2:
        storage.prepare_stage = prepare_after_written
    try:
        outcome = catch(save_checkpoint, opt, root)
    finally:
        storage.write_file, storage.prepare_stage, storage.commit = saved
    torch.distributed.barrier(group=ctx.group)
    return outcome, diff(read_state_dict(root), opt.state_dict(all_ranks=True))


def test_a_save_in_flight_survives_another_groups_stale_sibling_sweep(pool, tmp_path):
    results = pool.run(sweep_task, str(tmp_path / "c"), str(tmp_path / "meet"), world_size=4)
    assert results == [(("ok", None), None)] * 4  # both saves committed, the survivor whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "meet"]
