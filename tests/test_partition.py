"""Pure tests of the partition rules (no processes)."""

import pytest

from oss_plus.planning.partition import ParamSpec, Rule, assign_owners


def specs(*sizes, frozen=()):
    return [ParamSpec(n, i not in frozen) for i, n in enumerate(sizes)]


def test_fairscale_rule_is_greedy_in_given_order():
    assert assign_owners([specs(10, 3, 4, 1)], 2) == [[0, 1, 1, 1]]
    assert assign_owners([specs(1, 3, 4, 10)], 2) == [[0, 1, 0, 1]]


def test_fairscale_rule_frozen_param_weighs_one():
    # the frozen 100 weighs 1, so rank 1 keeps taking params; counted fully it would not
    assert assign_owners([specs(10, 100, 5, 7, frozen={1})], 2) == [[0, 1, 1, 1]]
    assert assign_owners([specs(10, 100, 5, 7)], 2) == [[0, 1, 0, 0]]


def test_fairscale_rule_totals_carry_across_groups():
    assert assign_owners([specs(10), specs(4, 4)], 2) == [[0], [1, 1]]


def test_ties_go_to_the_first_rank():
    assert assign_owners([specs(5, 5, 5, 5)], 4) == [[0, 1, 2, 3]]


def test_torch_rule_sorts_largest_first_and_counts_frozen_fully():
    assert assign_owners([specs(3, 10, 4)], 2, Rule.TORCH) == [[1, 0, 1]]
    assert assign_owners([specs(3, 10, 4, frozen={1})], 2, "torch") == [[1, 0, 1]]


def test_torch_rule_sort_is_stable():
    assert assign_owners([specs(4, 4, 4)], 2, "torch") == [[0, 1, 0]]


def test_fixed_owners_are_kept_and_counted():
    owners = assign_owners([specs(10, 10), specs(3, 3)], 2, fixed={(0, 0): 1, (0, 1): 1})
    assert owners == [[1, 1], [0, 0]]


def test_extension_equals_fresh_partition_when_nothing_changed():
    groups = [specs(7, 3, 9), specs(2, 8, 1, 6)]
    fresh = assign_owners(groups, 3)
    fixed = {(0, i): r for i, r in enumerate(fresh[0])}
    assert assign_owners(groups, 3, fixed=fixed) == fresh


def test_every_rank_appears_in_empty_and_single_cases():
    assert assign_owners([[]], 3) == [[]]
    assert assign_owners([specs(1)], 1) == [[0]]


def rank_loads(groups, owners, world):
    """Trainable elements per rank (the optimizer-state balance), counted here."""
    loads = [0] * world
    for group, ranks in zip(groups, owners):
        for spec, rank in zip(group, ranks):
            loads[rank] += spec.numel if spec.trainable else 0
    return loads


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([specs(1)], bad)


def test_bad_fixed_owner():
    with pytest.raises(ValueError, match="outside"):
        assign_owners([specs(1)], 2, fixed={(0, 0): 2})


def test_negative_numel_rejected():
    with pytest.raises(ValueError, match="numel"):
        ParamSpec(-1)


def test_balance_is_within_one_largest_param():
    import random

    rng = random.Random(0)
    for world in (2, 3, 4):
        groups = [[ParamSpec(rng.randint(1, 1000)) for _ in range(50)]]
        for rule in (Rule.FAIRSCALE, Rule.TORCH):  # the whole-tensor rules
            loads = rank_loads(groups, assign_owners(groups, world, rule), world)
            assert max(loads) - min(loads) <= 1000
