"""Tests of the distributed worker pool itself (:mod:`oss_plus.testing`)."""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from oss_plus.testing import PoolTimeout, RankContext, RemoteError, WorkerPool

# Task functions must live at module level: they are pickled by reference.


def _describe(ctx: RankContext) -> dict[str, Any]:
    total = torch.tensor([float(ctx.global_rank + 1)])
    dist.all_reduce(total, group=ctx.group)
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "global_rank": ctx.global_rank,
        "group_rank": dist.get_rank(ctx.group),
        "group_size": dist.get_world_size(ctx.group),
        "is_world": ctx.group is dist.group.WORLD,
        "sum": total.item(),
        "device": str(ctx.device),
    }


def _tensors(ctx: RankContext) -> dict[str, torch.Tensor]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (ctx.rank + 1)
    return {
        "base": base,
        "view": base.t()[1:],
        "half": base.to(torch.bfloat16),
        "long": base.long(),
    }


def _fail_on(ctx: RankContext, failing: tuple[int, ...]) -> int:
    if ctx.rank in failing:
        raise ValueError(f"boom on rank {ctx.rank}")
    dist.barrier(group=ctx.group)  # the healthy ranks get stuck waiting on the failed one
    return ctx.rank


def _hang(ctx: RankContext) -> int:
    if ctx.rank == 0:
        dist.barrier(group=ctx.group)  # nobody else enters it
    return ctx.rank


def _exit_on_rank_1(ctx: RankContext, how: str) -> int:
    if ctx.rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier(group=ctx.group)
    return ctx.rank


def _two_groups(ctx: RankContext) -> tuple[float, float]:
    pair = (0, 1) if ctx.global_rank < 2 else (2, 3)
    own = torch.tensor([float(ctx.global_rank + 1)])
    dist.all_reduce(own, group=ctx.groups[pair])
    world = torch.tensor([1.0])
    dist.all_reduce(world, group=ctx.group)
    return own.item(), world.item()


def _random_and_warn(ctx: RankContext, set_error_filter: bool) -> list[float]:
    values = torch.rand(3).tolist()
    warnings.warn("a harmless warning", UserWarning, stacklevel=1)
    if set_error_filter:
        warnings.simplefilter("error")
    return values


def _unpicklable_result(ctx: RankContext) -> Any:
    return lambda: None


def _echo(
    ctx: RankContext, *args: Any, **kwargs: Any
) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
    return ctx.rank, args, kwargs


def _assert_healthy(pool: WorkerPool) -> None:
    assert [r["sum"] for r in pool.run(_describe, world_size=4)] == [10.0] * 4


@pytest.mark.parametrize(
    ("world_size", "ranks"),
    [(1, None), (2, None), (3, None), (4, None), (2, (2, 3)), (3, (1, 2, 3))],
)
def test_results_ordered_by_rank(
    pool: WorkerPool, world_size: int, ranks: tuple[int, ...] | None
) -> None:
    global_ranks = ranks if ranks is not None else tuple(range(world_size))
    results = pool.run(_describe, world_size=world_size, ranks=ranks)
    expected_sum = float(sum(r + 1 for r in global_ranks))
    assert len(results) == len(global_ranks)
    for rank, (global_rank, result) in enumerate(zip(global_ranks, results, strict=True)):
        assert result == {
            "rank": rank,
            "world_size": len(global_ranks),
            "global_rank": global_rank,
            "group_rank": rank,
            "group_size": len(global_ranks),
            "is_world": False,
            "sum": expected_sum,
            "device": "cpu",
        }


def test_args_and_kwargs_are_passed(pool: WorkerPool) -> None:
    results = pool.run(_echo, 1, "a", world_size=2, key=[3])
    assert results == [(rank, (1, "a"), {"key": [3]}) for rank in range(2)]


def test_tensor_results_come_back_intact(pool: WorkerPool) -> None:
    results = pool.run(_tensors, world_size=2)
    for rank, result in enumerate(results):
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
        torch.testing.assert_close(result["base"], base)
        torch.testing.assert_close(result["view"], base.t()[1:])
        assert result["half"].dtype == torch.bfloat16
        torch.testing.assert_close(result["half"], base.to(torch.bfloat16))
        assert result["long"].dtype == torch.int64
        assert torch.equal(result["long"], base.long())


@pytest.mark.parametrize("failing", [(1,), (0, 2)])
def test_exception_raises_remote_error_quickly(pool: WorkerPool, failing: tuple[int, ...]) -> None:
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        pool.run(_fail_on, failing, world_size=3, timeout=60)
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    for rank in failing:
        assert f"rank {rank} (global rank {rank}) failed" in message
        assert f"ValueError: boom on rank {rank}" in message
    assert "Traceback (most recent call last)" in message
    assert "_fail_on" in message
    assert sorted(info.value.failures) == list(failing)
    _assert_healthy(pool)


def test_hang_raises_pool_timeout(pool: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(PoolTimeout) as info:
        pool.run(_hang, world_size=2, timeout=5)
    elapsed = time.monotonic() - start
    assert 5.0 <= elapsed < 9.0
    assert "ranks [0]" in str(info.value)
    assert info.value.missing == [0]
    _assert_healthy(pool)


@pytest.mark.parametrize(
    ("how", "expected"), [("exit", "exit code 3"), ("sigkill", "exit code -9 (killed by SIGKILL)")]
)
def test_dead_worker_reported_with_exit_code(pool: WorkerPool, how: str, expected: str) -> None:
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        pool.run(_exit_on_rank_1, how, world_size=2, timeout=60)
    assert time.monotonic() - start < 5.0
    assert "rank 1 (global rank 1) failed" in str(info.value)
    assert expected in str(info.value)
    _assert_healthy(pool)


def test_two_groups_at_once(pool: WorkerPool) -> None:
    results = pool.run(_two_groups, ranks=(0, 1, 2, 3))
    assert results == [(3.0, 4.0), (3.0, 4.0), (7.0, 4.0), (7.0, 4.0)]


def test_fresh_seed_and_warning_filters_per_task(pool: WorkerPool) -> None:
    first = pool.run(_random_and_warn, True, world_size=2)
    # The second run would raise if the first one's "error" filter leaked.
    second = pool.run(_random_and_warn, False, world_size=2)
    torch.manual_seed(0)
    assert first == second == [torch.rand(3).tolist()] * 2


def test_unpicklable_result_is_a_remote_error(pool: WorkerPool) -> None:
    with pytest.raises(RemoteError, match="rank 0"):
        pool.run(_unpicklable_result, world_size=1)
    _assert_healthy(pool)


def test_bad_requests_fail_locally(pool: WorkerPool) -> None:
    with pytest.raises(ValueError, match="no group"):
        pool.run(_describe, ranks=(0, 3))
    with pytest.raises(TypeError, match="module-level"):
        pool.run(lambda ctx: None, world_size=2)
    _assert_healthy(pool)
