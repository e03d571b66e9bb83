"""Errors raised on every rank name the failed process by its global rank (issue 49, item 7).

A group that is not numbered like the world (the offset group [2, 3], a hybrid replicate
group [1, 3]) used to be reported in group ranks without saying so: global rank 3 read
"rank(s) [0] ... rank 0 raised" about global rank 1. The texts are built here by hand from
the global ranks the pool ran on, not by the code under test.
"""

from __future__ import annotations

import torch.distributed as dist
from helpers import catch

from oss_plus import hybrid_groups
from oss_plus.runtime.dist import name_rank, name_ranks, peer_failed, run_phase
from oss_plus.wire.status import REPLAN, replan_message

BOOM = "injected on global rank {rank}"


# ------------------------------------------------------------------ pure
def test_a_group_numbered_like_the_world_is_named_by_global_ranks_only():
    assert name_ranks([0, 1, 2], [0, 2]) == "global rank(s) [0, 2]"
    assert name_rank([0, 1], 1) == "global rank 1"


def test_another_group_names_global_ranks_and_the_ranks_within_it():
    assert name_ranks([1, 3], [0]) == "global rank(s) [1] (rank(s) [0] of the group [1, 3])"
    assert name_rank([2, 3], 0) == "global rank 2 (rank 0 of the group [2, 3])"
    members = list(range(8, 24))  # a long group is abbreviated
    assert name_ranks(members, [1]) == (
        "global rank(s) [9] (rank(s) [1] of the group [8, 9, ..., 23] (16 ranks))"
    )


def test_peer_failed_says_who_failed_and_who_stopped():
    text = peer_failed([1, 3], [0], 1)
    assert text.startswith("global rank(s) [1] (rank(s) [0] of the group [1, 3]) failed")
    assert "this rank (global rank 3) stopped too" in text


def test_replan_names_global_ranks():
    text = replan_message([0, REPLAN], [2, 3])
    assert text.startswith(
        "requires_grad changed on global rank(s) [3] (rank(s) [1] of the group [2, 3]) but "
        "not on global rank(s) [2] (rank(s) [0] of the group [2, 3])"
    )


# ------------------------------------------------------------------ through the pool
def _fail_on(global_rank: int) -> None:
    if dist.get_rank() == global_rank:
        raise ValueError(BOOM.format(rank=global_rank))


def offset_task(ctx, failing):
    return catch(run_phase, lambda: _fail_on(failing), ctx.group)


def test_a_failure_on_the_offset_group_names_the_global_rank(pool):
    """Group [2, 3]: global rank 3 (group rank 1) fails; global rank 2 must name 3."""
    mine, theirs = reversed(pool.run(offset_task, 3, ranks=(2, 3)))
    assert mine == ("ValueError", BOOM.format(rank=3))
    head = "global rank(s) [3] (rank(s) [1] of the group [2, 3]) failed (see their error); "
    head += "this rank (global rank 2) stopped too"
    assert theirs[0] == "ValueError" and theirs[1].startswith(head), theirs
    assert f"; global rank 3 raised ValueError: {BOOM.format(rank=3)}" in theirs[1], theirs


def replicate_task(ctx, failing):
    _, replicate = hybrid_groups(2)  # shard groups [0, 1], [2, 3]; replicate [0, 2], [1, 3]
    return catch(run_phase, lambda: _fail_on(failing), replicate)


def test_a_failure_in_a_hybrid_replicate_group_names_the_global_rank(pool):
    """The issue's case: global rank 1 fails in the replicate group [1, 3]; global rank 3
    named it "rank(s) [0] ... rank 0 raised"."""
    results = pool.run(replicate_task, 1, world_size=4)
    assert results[1] == ("ValueError", BOOM.format(rank=1))
    assert results[0] == results[2] == ("ok", None)  # the other replicate group went on
    kind, text = results[3]
    head = "global rank(s) [1] (rank(s) [0] of the group [1, 3]) failed (see their error); "
    assert kind == "ValueError" and text.startswith(head + "this rank (global rank 3)"), text
    assert f"; global rank 1 raised ValueError: {BOOM.format(rank=1)}" in text, text


def arrival_task(ctx):
    from datetime import timedelta

    from oss_plus.runtime.arrival import check_arrival

    if ctx.global_rank == 3:  # global rank 2 never calls
        return catch(check_arrival, ctx.group, "names_test()", timedelta(seconds=0.5))
    return None


def test_a_rank_left_alone_says_which_process_it_is(pool):
    alone = pool.run(arrival_task, ranks=(2, 3))[1]
    assert alone[0] == "RuntimeError", alone
    assert "(this is global rank 3 (rank 1 of the group [2, 3]))" in alone[1], alone
