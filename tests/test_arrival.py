"""Every collective entry point checks that every rank entered it (issue 36, item 2).

A collective call made on some ranks only (mmengine's ``CheckpointHook`` consolidates on the
saving rank alone) used to wait in its first collective for the process group's timeout (30
minutes by default; 30 s in the pool). Now the ranks that made it raise RuntimeError naming
the call within the arrival timeout (1 s here), the others are not involved, and the same
call made later on every rank works. Without the check the callers sit in a collective until
the pool's task timeout (below the group's): each test then fails.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import pytest
import torch
from helpers import backward, catch, make_model, train

from oss_plus import OSS, ShardedDataParallel, load_checkpoint, save_checkpoint
from oss_plus.compat import fairscale
from oss_plus.compat import torch as torch_compat
from oss_plus.runtime import arrival as _arrival

#: The arrival timeout in these tests (seconds), and what a caller may take at most to raise.
SHORT_S = 1.0
BOUND_S = 10.0
#: Below the pool's group timeout (30 s): a caller stuck in a collective fails the test.
TASK_TIMEOUT_S = 25.0


def _sdp_refresh(opt, sdp, path):
    return sdp.refresh_trainable()


#: name in the error -> (optimizer kind, the call made by some ranks, then by every rank)
ENTRY_POINTS = {
    # on every rank (-1) it is collective; to one rank, that rank reads alone (issue 56,
    # tests/test_state_read.py)
    "consolidate_state_dict()": ("oss", lambda opt, sdp, path: opt.consolidate_state_dict(-1)),
    "state_dict(all_ranks=True)": ("oss", lambda opt, sdp, path: opt.state_dict(True)),
    "refresh_trainable()": ("oss", lambda opt, sdp, path: opt.refresh_trainable()),
    "repartition()": ("oss", lambda opt, sdp, path: opt.repartition()),
    "add_param_group()": (
        "oss",
        lambda opt, sdp, path: opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(3))]}
        ),
    ),
    "clip_grad_norm()": ("oss", lambda opt, sdp, path: opt.clip_grad_norm(1.0)),
    "save_checkpoint()": ("oss", lambda opt, sdp, path: save_checkpoint(opt, path)),
    "save_checkpoint(blocking=False)": (
        "oss",
        lambda opt, sdp, path: save_checkpoint(opt, path, blocking=False).result(),
    ),
    "load_checkpoint()": ("oss", lambda opt, sdp, path: load_checkpoint(opt, path)),
    "fairscale consolidate_state_dict()": (
        "fairscale",
        lambda opt, sdp, path: opt.consolidate_state_dict(recipient_rank=-1),
    ),
    "torch consolidate_state_dict()": (
        "torch",
        lambda opt, sdp, path: opt.consolidate_state_dict(to=-1),
    ),
    "ShardedDataParallel.refresh_trainable()": ("sdp", _sdp_refresh),
}


def named(entry: str) -> str:
    """The call's name in the error (the adapters' calls go through the core's)."""
    if entry.startswith(("fairscale ", "torch ")):
        return entry.split(" ", 1)[1]
    if entry.startswith("ShardedDataParallel."):
        return entry.split(".", 1)[1]
    return entry.replace("(blocking=False)", "()")


class short_arrival:
    """Set :data:`_arrival.ARRIVAL_TIMEOUT_ENV` for the block (in a pool worker)."""

    def __init__(self, seconds: float = SHORT_S) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        self.saved = os.environ.get(_arrival.ARRIVAL_TIMEOUT_ENV)
        os.environ[_arrival.ARRIVAL_TIMEOUT_ENV] = str(self.seconds)

    def __exit__(self, *exc: object) -> None:
        if self.saved is None:
            os.environ.pop(_arrival.ARRIVAL_TIMEOUT_ENV, None)
        else:
            os.environ[_arrival.ARRIVAL_TIMEOUT_ENV] = self.saved


def adam_of_kind(ctx, kind, params):
    """Adam sharded over ``ctx.group`` by the fairscale adapter, the torch adapter or OSS."""
    if kind == "fairscale":
        return fairscale.OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01)
    if kind == "torch":
        return torch_compat.ZeroRedundancyOptimizer(
            params, torch.optim.Adam, process_group=ctx.group, lr=0.01
        )
    return OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01)


def build(ctx, kind):
    model = make_model()
    opt = adam_of_kind(ctx, kind, model.parameters())
    sdp = ShardedDataParallel(model, opt, ctx.group) if kind == "sdp" else None
    return sdp or model, opt, sdp


def wait_for(store, key: str, count: int, seconds: float = 20.0) -> None:
    """Wait until ``count`` ranks added 1 to ``key`` (out of band: the store)."""
    deadline = time.monotonic() + seconds
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: fewer than {count} ranks came")
        time.sleep(0.01)


def alone_task(ctx, entry, callers, path, tag):
    kind, call = ENTRY_POINTS[entry]
    net, opt, sdp = build(ctx, kind)  # under the default timeout: a slow start is fine
    train(net, opt, 2)
    if entry == "load_checkpoint()":
        save_checkpoint(opt, path)
    backward(net, 2)  # gradients for the clip
    with short_arrival():
        store = _arrival._store()
        alone, elapsed = None, 0.0
        if ctx.rank in callers:
            begin = time.monotonic()
            alone = catch(call, opt, sdp, path)
            elapsed = time.monotonic() - begin
            store.add(f"{tag}/done", 1)
        else:  # does something else meanwhile (no collective)
            wait_for(store, f"{tag}/done", len(callers))
        together = catch(call, opt, sdp, path)  # the same call on every rank: works
        train(net, opt, 1, start=2)  # and training goes on
        return alone, elapsed, together[0]


WORLDS = [(2, (1,)), (3, (0, 2))]  # (world size, the ranks that call)


@pytest.mark.parametrize("world,callers", WORLDS, ids=["ws2-rank1", "ws3-ranks0,2"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_call_on_some_ranks_raises_there_naming_it_and_recovers(
    pool, tmp_path, entry, world, callers
):
    tag = f"test_arrival/{uuid.uuid4().hex}"
    results = pool.run(
        alone_task,
        entry,
        callers,
        str(tmp_path / "ckpt"),
        tag,
        world_size=world,
        timeout=TASK_TIMEOUT_S,
    )
    for rank, (alone, elapsed, together) in enumerate(results):
        assert together == "ok", (rank, together)
        if rank not in callers:
            assert alone is None
            continue
        kind, message = alone
        assert kind == "RuntimeError", alone
        assert message.startswith(
            f"{named(entry)} is collective but only {len(callers)} of the {world} ranks"
        ), message
        assert f"within {SHORT_S:g}s (this is global rank {rank})" in message
        assert SHORT_S * 0.9 <= elapsed < BOUND_S, elapsed


def different_calls_task(ctx, tag):
    """Rank 0 consolidates while rank 1 clips: each raises naming its own call."""
    model, opt, _ = build(ctx, "oss")
    train(model, opt, 1)
    backward(model, 1)
    with short_arrival():
        # rank 0 consolidates, rank 1 clips
        got = (
            catch(opt.consolidate_state_dict, -1)
            if ctx.rank == 0
            else catch(opt.clip_grad_norm, 1.0)
        )
        store = _arrival._store()
        store.add(f"{tag}/done", 1)  # both failed (else rank 1 could still meet rank 0 there)
        wait_for(store, f"{tag}/done", 2)
        opt.consolidate_state_dict()  # then the same call on both: works
        return got


def test_different_calls_on_different_ranks_raise_each_naming_its_own(pool):
    tag = f"test_arrival/{uuid.uuid4().hex}"
    first, second = pool.run(different_calls_task, tag, world_size=2, timeout=TASK_TIMEOUT_S)
    assert first[0] == second[0] == "RuntimeError"
    assert first[1].startswith("consolidate_state_dict() is collective but only 1 of the 2")
    assert second[1].startswith("clip_grad_norm() is collective but only 1 of the 2")


def nested_task(ctx):
    """How many store checks each entry point makes (a nested entry point is not checked
    again), and how many keys the store gains over many checked calls."""
    made = []
    original = _arrival.check_arrival

    def counting(group, what, timeout=None, **kw):
        made.append(what)
        return original(group, what, timeout, **kw)

    _arrival.check_arrival = counting
    try:
        model, opt, _ = build(ctx, "oss")
        train(model, opt, 1)
        opt.state_dict(all_ranks=True)
        opt.refresh_trainable()
        nested = list(made)
        store = _arrival._store()
        backward(model, 1)
        opt.clip_grad_norm(1.0)
        before = store.num_keys()
        for _ in range(30):
            opt.clip_grad_norm(1.0)
        return nested, store.num_keys() - before
    finally:
        _arrival.check_arrival = original


def test_nested_entry_points_check_once_and_the_store_keeps_one_calls_keys(pool):
    for nested, grown in pool.run(nested_task, world_size=3):
        # construction checks arrival too (tests/test_out_of_step.py)
        assert nested == ["OSS()", "state_dict(all_ranks=True)", "refresh_trainable()"]
        assert grown <= 0, grown  # 30 calls: the keys of the previous call are deleted


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(_arrival.ARRIVAL_TIMEOUT_ENV, raising=False)
    assert _arrival.arrival_timeout() == _arrival.ARRIVAL_TIMEOUT == timedelta(seconds=60)
    monkeypatch.setenv(_arrival.ARRIVAL_TIMEOUT_ENV, "2.5")
    assert _arrival.arrival_timeout() == timedelta(seconds=2.5)
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(_arrival.ARRIVAL_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=_arrival.ARRIVAL_TIMEOUT_ENV):
            _arrival.arrival_timeout()


class _Store:
    """Stands for a default group's store: only its identity matters to the counts."""


def test_a_new_store_at_a_freed_stores_address_starts_the_counts_again():
    """The counts of calls belong to one default group. A group destroyed and made again
    gets a new store; CPython may place it at the address of the freed one, on one rank and
    not on another. Counts kept by ``id()`` then carried over on one rank only, and the ranks
    waited on different keys until the arrival timeout (a flaky ``test_reinit`` in CI)."""
    ranks = (0, 1)
    first = _Store()
    _arrival._counts(first, ranks).calls = 5
    assert _arrival._counts(first, ranks).calls == 5  # the same group keeps its counts
    address = id(first)
    del first
    later = [_Store() for _ in range(64)]  # CPython reuses a freed block of the same size
    reused = [s for s in later if id(s) == address]
    assert reused, "no new store took the freed address: the case is not reached"
    assert _arrival._counts(reused[0], ranks).calls == 0
