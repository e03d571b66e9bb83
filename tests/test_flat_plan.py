"""The flat partition rule as a pure plan (no processes): pieces, balance, consistency."""

from __future__ import annotations

import random

import pytest

from oss_plus.planning.partition import ParamSpec, Piece, Rule, cut_flat, flat_offsets
from oss_plus.planning.plan import ShardPlan, make_plan
from oss_plus.planning.policy import ShardPolicy

FLAT = ShardPolicy(rule="flat")


def _covered(plan: ShardPlan) -> None:
    """Every param is covered by its pieces, in order, independently of the plan's checks."""
    for i, n in enumerate(plan.numels):
        pieces = [p for p in plan.pieces if p.index == i]
        assert pieces[0].start == 0 and pieces[-1].end == n
        assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
        assert len({p.owner for p in pieces}) == len(pieces)  # one piece per rank at most


def test_a_param_is_cut_at_the_range_boundary() -> None:
    plan = make_plan([[ParamSpec(10), ParamSpec(6)]], 2, FLAT)
    assert plan.pieces == (Piece(0, 0, 8, 0), Piece(0, 8, 10, 1), Piece(1, 0, 6, 1))
    assert plan.split == {0}
    assert plan.owners == (0, 1)
    assert plan.local_indices(1) == [[0, 1]] and plan.local_indices(0) == [[0]]
    assert plan.piece(1, 0) == Piece(0, 8, 10, 1) and plan.piece(0, 1) is None
    assert plan.rank_loads() == [8, 8]


def test_offsets_and_ranges_are_aligned() -> None:
    offsets, region = flat_offsets([10, 3, 4], 4, 2)
    assert offsets == [0, 12, 16] and region == 12
    specs = [[ParamSpec(n, align=16) for n in (100, 37, 250, 5)]]
    for world in (1, 2, 3, 4, 7):
        plan = make_plan(specs, world, FLAT)
        _covered(plan)
        _, region = flat_offsets([100, 37, 250, 5], 16, world)
        assert region % 16 == 0
        for p in plan.pieces:  # a cut inside a param is at an aligned element of it
            if p.start:
                assert p.start % 16 == 0


def test_frozen_params_stay_whole_and_out_of_the_balance() -> None:
    specs = [[ParamSpec(64), ParamSpec(1000, trainable=False), ParamSpec(64)]]
    plan = make_plan(specs, 2, FLAT)
    assert [p for p in plan.pieces if p.index == 1] == [Piece(1, 0, 1000, 0)]
    assert plan.rank_loads() == [64, 64]


def test_keys_are_cut_separately() -> None:
    specs = [[ParamSpec(100, key="a"), ParamSpec(100, key="b"), ParamSpec(100, key="a")]]
    plan = make_plan(specs, 2, FLAT)
    assert plan.rank_loads() == [150, 150]
    assert {p.owner for p in plan.pieces if p.index == 1} == {0, 1}


def test_one_rank_owns_everything_whole() -> None:
    plan = make_plan([[ParamSpec(10), ParamSpec(6, trainable=False)]], 1, FLAT)
    assert not plan.split and plan.owners == (0, 0)


def test_rank_loads_of_the_whole_rules() -> None:
    specs = [[ParamSpec(10), ParamSpec(3), ParamSpec(4, trainable=False)]]
    assert make_plan(specs, 2).rank_loads() == [10, 3]
    assert make_plan(specs, 2, ShardPolicy("torch")).rank_loads() == [10, 3]


@pytest.mark.parametrize("world", [8, 64, 256, 1024])
def test_flat_is_balanced_where_whole_tensors_are_not(world: int) -> None:
    rng = random.Random(world)
    numels = [rng.choice([4096, 4096 * 11008, 32000 * 4096, 4096 * 4096]) for _ in range(200)]
    specs = [[ParamSpec(n, align=16) for n in numels]]
    ideal = sum(numels) / world
    flat = make_plan(specs, world, FLAT)
    _covered(flat)
    assert max(flat.rank_loads()) <= 1.01 * ideal
    assert sum(flat.rank_loads()) == sum(numels)
    if world >= 256:  # 200 whole tensors can not fill that many ranks: what flat is for
        whole = make_plan(specs, world, ShardPolicy("torch"))
        assert max(whole.rank_loads()) > 1.5 * ideal


def test_changed_lists_the_params_whose_pieces_moved() -> None:
    a = make_plan([[ParamSpec(10), ParamSpec(6)]], 2, FLAT)
    b = make_plan([[ParamSpec(10), ParamSpec(6, trainable=False)]], 2, FLAT)
    assert a.changed(b) == [0, 1]
    assert a.changed(a) == []
    with pytest.raises(ValueError, match="split"):
        a.moves(b)


def test_inconsistent_pieces_are_refused() -> None:
    good = make_plan([[ParamSpec(10), ParamSpec(6)]], 2, FLAT)
    fields = {k: getattr(good, k) for k in good.__dataclass_fields__}
    with pytest.raises(ValueError, match="cover"):
        ShardPlan(**{**fields, "pieces": good.pieces[:1] + good.pieces[2:]})
    with pytest.raises(ValueError, match="continue"):
        ShardPlan(**{**fields, "pieces": (Piece(0, 0, 7, 0),) + good.pieces[1:]})


def test_assign_owners_refuses_the_flat_rule() -> None:
    from oss_plus.planning.partition import assign_owners

    with pytest.raises(ValueError, match="cut_flat"):
        assign_owners([[ParamSpec(3)]], 2, Rule.FLAT)
    assert cut_flat([[ParamSpec(3)]], 2) == [Piece(0, 0, 2, 0), Piece(0, 2, 3, 1)]
