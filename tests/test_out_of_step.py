"""A rank out of step raises a clear error on every rank within the arrival timeout (issue 55).

One rank skips a ``step()`` (a "skip on a non-finite loss" that is not agreed), calls it
twice, or makes another collective call while its peers step; an ``OSS`` is constructed on
some ranks only. Before, these waited for the process group's timeout, paired a step with
another silently, or raised gloo's raw "Connection closed by peer". Now the step's waits are
bounded by the arrival timeout (1 s here) and every rank that is in an oss_plus call raises
naming where every rank is (:mod:`oss_plus.runtime.positions`). Without the bounded waits
the stepping rank sits in its sync until the pair's timeout (6 s) and raises gloo's error:
each test then fails on the message.

A half-done collective stays queued in the group it ran on, so each scenario runs on a pair
group made for it (``dist.new_group`` on all four workers, then abandoned): two scenarios per
4-rank task, on ranks (0, 1) and (2, 3) at once, and the pool's own groups stay usable.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import backward, catch, ddp_of, loss_of, make_model, run_python
from test_arrival import adam_of_kind, short_arrival, wait_for

from oss_plus import OSS, ShardedDataParallel, save_checkpoint
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import positions
from oss_plus.step import driver as _driver

#: What a rank may take at most to raise (1 s arrival timeout, 1 s grace, a loaded machine).
BOUND_S = 10.0
TASK_TIMEOUT_S = 40.0
#: The timeout of the pair groups (what the other rank under plain DDP waits for).
PAIR_TIMEOUT = timedelta(seconds=6)


def build(ctx, kind):
    model = make_model()
    opt = adam_of_kind(ctx, kind, model.parameters())
    net: torch.nn.Module = model
    if kind == "ddp":
        net = ddp_of(ctx, model)
    elif kind == "sdp":
        net = ShardedDataParallel(model, opt, ctx.group)
    elif kind == "attach":
        opt.attach(model)
    return net, opt


def iteration(net, opt, it: int, step: bool = True, twice: bool = False) -> None:
    opt.zero_grad()
    loss_of(net, it).backward()
    if step:
        opt.step()
    if twice:
        opt.step()


def timed(fn, *args):
    begin = time.monotonic()
    got = catch(fn, *args)
    return [*got, time.monotonic() - begin]


def skipped(ctx, kind, mistake):
    """Rank 1 skips its second step (or rank 0 steps twice in its second iteration); the
    loop goes on, then every rank consolidates."""
    net, opt = build(ctx, kind)  # under the default timeout: a slow start is fine

    def loop():
        for it in range(3):
            skip = mistake == "skip" and ctx.rank == 1 and it == 1
            twice = mistake == "twice" and ctx.rank == 0 and it == 1
            iteration(net, opt, it, step=not skip, twice=twice)
        opt.consolidate_state_dict()

    with short_arrival():
        return [*timed(loop), opt.step_count]


def mixed(ctx, call):
    """Rank 0 steps while rank 1 clips, consolidates or saves a checkpoint."""
    net, opt = build(ctx, "oss")
    iteration(net, opt, 0)
    backward(net, 1)
    calls = {
        "clip_grad_norm()": lambda: opt.clip_grad_norm(1.0),
        "consolidate_state_dict()": opt.consolidate_state_dict,
        "save_checkpoint()": lambda: save_checkpoint(opt, ctx.path),
    }
    with short_arrival():
        return timed(opt.step if ctx.rank == 0 else calls[call])


SCENARIOS = {
    **{f"{kind}-skip": (skipped, kind, "skip") for kind in ("oss", "fairscale", "torch")},
    **{f"{kind}-skip": (skipped, kind, "skip") for kind in ("attach", "sdp", "ddp")},
    "oss-twice": (skipped, "oss", "twice"),
    "sdp-twice": (skipped, "sdp", "twice"),
    **{call: (mixed, call) for call in ("clip_grad_norm()", "save_checkpoint()")},
}


def pairs_task(ctx, first, second, path):
    """``first`` on global ranks (0, 1), ``second`` on (2, 3), each on a pair group of its own."""
    pairs = [dist.new_group(r, timeout=PAIR_TIMEOUT) for r in ((0, 1), (2, 3))]
    group = pairs[ctx.global_rank // 2]
    name = first if ctx.global_rank < 2 else second
    mine = SimpleNamespace(
        group=group, rank=dist.get_rank(group), global_rank=ctx.global_rank, path=path + name
    )
    fresh(ctx, dist.get_process_group_ranks(group))
    fn, *args = SCENARIOS[name]
    return fn(mine, *args)


def fresh(ctx, ranks) -> None:
    """Withdraw what this worker posted in an earlier test (a position is read for a few
    seconds), then wait until every worker did, over the pool's own group."""
    positions.clear(_arrival._store(), ranks, ctx.global_rank)
    dist.barrier(group=ctx.group)


#: Rank 1's error in ``consolidate_state_dict()`` when rank 0 never reads its shard (issue 56).
NOT_READ_BY = (
    "consolidate_state_dict(recipient_rank=0) on this rank waits until global rank {first} "
)


def check_skipped(name, results, members):
    """Rank 0 of the pair made one step more; each rank names where the other is."""
    (kind0, text0, took0, steps0), (kind1, text1, took1, steps1) = results
    kind, mistake = name.split("-")
    first, second = members
    assert kind0 == "RuntimeError" and took0 < BOUND_S, (text0, took0)
    ahead, behind = 3 + (mistake == "twice"), 3 - (mistake == "skip")
    if kind == "attach":  # rank 0's last step returned with its sync in flight
        assert steps0 == ahead and steps1 == behind and kind1 == "RuntimeError"
        # rank 0 waits first for its last step's sync, which rank 1 never joins
        assert text0.startswith(
            f"step() is collective, but the parameter sync of this rank's step {ahead} "
        ), text0
        assert f"global rank {second} is in consolidate_state_dict() after {behind} step(s)" in (
            text0
        )
        assert text1.startswith(NOT_READ_BY.format(first=first)), text1
        return
    if kind in ("sdp", "ddp"):  # caught at the first step out of step: the next backward()
        ahead = 2 + (mistake == "twice")
    assert text0.startswith(
        f"step() is collective, but the parameter sync of this rank's step {ahead} "
    ), text0
    assert f"global rank {first} (this rank) is here" in text0, text0
    if kind == "ddp":  # rank 1 waits in DDP's own all-reduce: gloo's error at the pair timeout
        assert f"global rank {second} is in no collective call of oss_plus" in text0, text0
        assert kind1 == "RuntimeError" and not text1.startswith(("step()", "backward()")), text1
        return
    assert kind1 == "RuntimeError" and took1 < BOUND_S, (text1, took1)
    if kind == "sdp":  # rank 1 is in its next backward(), whose reduction pairs with nothing
        assert f"global rank {second} is in ShardedDataParallel's backward()" in text0, text0
        assert text1.startswith("backward() is collective, but one of its collectives"), text1
    else:
        assert steps1 == behind, steps1
        assert f"global rank {second} is in consolidate_state_dict() after {behind} step(s)" in (
            text0
        )
        assert text1.startswith(NOT_READ_BY.format(first=first)), text1
    assert f"global rank {first} is in step() (its step {ahead})" in text1, text1


def check_mixed(call, results, members):
    (kind0, text0, took0), (kind1, text1, took1) = results
    first, second = members
    assert kind0 == kind1 == "RuntimeError", (text0, text1)
    assert text0.startswith("step() is collective, but the parameter sync of this rank's step 2 ")
    assert f"global rank {second} is in {call} after 1 step(s)" in text0, text0
    assert text1.startswith(f"{call} is collective but only 1 of the 2"), text1
    assert f"global rank {first} is in step() (its step 2)" in text1, text1
    assert took0 < BOUND_S and took1 < BOUND_S, (took0, took1)


@pytest.mark.parametrize(
    "first,second",
    [
        ("oss-skip", "fairscale-skip"),
        ("torch-skip", "attach-skip"),
        ("sdp-skip", "oss-twice"),
        ("ddp-skip", "clip_grad_norm()"),
        ("sdp-twice", "save_checkpoint()"),
    ],
)
def test_a_rank_out_of_step_raises_naming_where_each_rank_is(pool, tmp_path, first, second):
    """Without DDP, with ``attach``, both adapters, ``ShardedDataParallel`` and DDP; a skipped
    and a doubled step; a step against a clip and a checkpoint save."""
    results = pool.run(
        pairs_task, first, second, str(tmp_path / "ckpt-"), world_size=4, timeout=TASK_TIMEOUT_S
    )
    for name, pair, members in ((first, results[:2], (0, 1)), (second, results[2:], (2, 3))):
        if name.endswith("()"):
            check_mixed(name, pair, members)
        else:
            check_skipped(name, pair, members)


def construct_task(ctx, tag):
    """Rank 0 constructs an OSS, rank 1 does not (it waits out of band); then both do."""
    got, store = None, _arrival._store()
    fresh(ctx, (0, 1))
    with short_arrival():
        if ctx.rank == 0:
            got = timed(lambda: OSS(make_model().parameters(), group=ctx.group))
            store.add(f"{tag}/done", 1)
        else:
            wait_for(store, f"{tag}/done", 1)
    net, opt = build(ctx, "oss")  # then on every rank: constructs and steps
    iteration(net, opt, 0)
    return got, opt.step_count


def test_an_oss_constructed_on_some_ranks_raises_there(pool):
    tag = f"test_out_of_step/{uuid.uuid4().hex}"
    (got, steps0), (none, steps1) = pool.run(
        construct_task, tag, world_size=2, timeout=TASK_TIMEOUT_S
    )
    assert none is None and steps0 == steps1 == 1
    kind, text, took = got
    assert kind == "RuntimeError" and text.startswith("OSS() is collective but only 1 of the 2")
    assert "global rank 1 is in no collective call of oss_plus" in text, text
    assert took < BOUND_S


def counted_task(ctx):
    """step_count counts the steps that ran the sync; the entry points compare it."""
    with short_arrival():
        net, opt = build(ctx, "oss")
        for it in range(2):
            iteration(net, opt, it)
        counts = [opt.step_count]
        opt.consolidate_state_dict()
        return counts


def test_step_count_is_the_same_on_every_rank(pool):
    assert pool.run(counted_task, world_size=2) == [[2], [2]]


def test_the_messages_name_what_to_do():
    assert "restart from a checkpoint" in _driver.STEP_NOT_MATCHED
    assert "every rank skips" in _arrival.STEPS_DIFFER


@pytest.mark.gpu
def test_on_cuda_the_count_and_the_bounded_waits_hold():
    """NCCL at world size 1 (the count, the copy refused), gloo with CUDA tensors at 2 ranks
    (exact steps, then a skipped step named on both ranks); tests/gpu_out_of_step.py."""
    done = run_python(["tests/gpu_out_of_step.py"], timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("{", "0 ", "1 "))]
    alone = json.loads(lines[0])
    assert alone == {
        "nccl_ws1_step_count": 3,
        "equal_to_plain": True,
        "deepcopy": alone["deepcopy"],
    } and alone["deepcopy"].startswith("OSS cannot be deep-copied")
    ranks = [json.loads(line.split(" ", 1)[1]) for line in lines[1:3]]
    for got in ranks:
        assert got["oss_equal_to_plain"] and got["attach_equal_to_plain"], got
        assert got["oss_step_count"] == got["attach_step_count"] == 3, got
        assert got["skip_s"] < BOUND_S, got
    assert ranks[0]["skip"].startswith("step() is collective, but the parameter sync"), ranks[0]
    assert "global rank 1 is in consolidate_state_dict() after 2 step(s)" in ranks[0]["skip"]
    assert ranks[1]["skip"].startswith("consolidate_state_dict() is collective but only 1")
