"""Pure tests of the shard plan and the policy (no processes), and of the OSS contract rule."""

from __future__ import annotations

import ast
import pathlib

import pytest

from oss_plus.planning import plan as plan_module
from oss_plus.planning.partition import ParamSpec, Rule, assign_owners
from oss_plus.planning.plan import ShardPlan, make_plan, plan_from_owners
from oss_plus.planning.policy import BAD_POLICY, Layout, LocalOrder, ShardPolicy


def specs(*sizes, frozen=()):
    return [ParamSpec(n, i not in frozen) for i, n in enumerate(sizes)]


def test_plan_owners_match_the_partition_rules():
    groups = [specs(3, 10, 4), specs(7, 1)]
    for rule in (Rule.FAIRSCALE, Rule.TORCH):  # the whole-tensor rules
        plan = make_plan(groups, 3, ShardPolicy(rule=rule))
        expected = assign_owners(groups, 3, rule)
        assert plan.owners_by_group() == expected
        assert plan.owners == tuple(o for g in expected for o in g)


def test_local_views_partition_every_param_exactly_once():
    groups = [specs(3, 10, 4, 4), specs(), specs(7, 1, 2)]
    plan = make_plan(groups, 3)
    seen = sorted(i for r in range(3) for g in plan.local_indices(r) for i in g)
    assert seen == list(range(7))
    for r in range(3):
        assert len(plan.local_indices(r)) == 3  # one (possibly empty) group per global group
        assert sorted(i for g in plan.local_indices(r) for i in g) == plan.owned(r)


def test_local_order_largest_first_or_as_the_rule_visits():
    groups = [specs(1, 5, 3, 5)]
    largest = make_plan(groups, 1, ShardPolicy(local_order=LocalOrder.LARGEST_FIRST))
    assert largest.local_indices(0) == [[1, 3, 2, 0]]  # stable among equal sizes
    given = make_plan(groups, 1, ShardPolicy(local_order="rule"))
    assert given.local_indices(0) == [[0, 1, 2, 3]]
    torch_rule = make_plan(groups, 1, ShardPolicy(rule="torch", local_order="rule"))
    assert torch_rule.local_indices(0) == [[1, 3, 2, 0]]


def test_keep_places_only_the_new_params():
    first = make_plan([specs(10, 1)], 2)
    grown = make_plan([specs(10, 1), specs(4, 4)], 2, keep=first)
    assert grown.owners[:2] == first.owners
    fresh = assign_owners([specs(10, 1), specs(4, 4)], 2, fixed={(0, 0): 0, (0, 1): 1})
    assert grown.owners_by_group() == fresh


def test_moves_lists_every_changed_owner():
    a = plan_from_owners([specs(1, 1, 1)], [[0, 1, 0]], [[0, 1, 2]], 2)
    b = plan_from_owners([specs(1, 1, 1)], [[1, 1, 0]], [[0, 1, 2]], 2)
    assert a.moves(b) == [(0, 0, 1)]
    assert a.moves(a) == []


def test_plan_is_frozen_and_validated():
    plan = make_plan([specs(2, 2)], 2)
    with pytest.raises(AttributeError):
        plan.owners = (0, 0)  # type: ignore[misc]
    with pytest.raises(ValueError, match="local view of rank 0"):
        ShardPlan(2, Rule.FAIRSCALE, (2,), (0, 1), (((1,),), ((0,),)), (2, 2), (True, True))
    with pytest.raises(ValueError, match="2 params in the groups but 1 owners"):
        ShardPlan(1, Rule.FAIRSCALE, (2,), (0,), (((0,),),), (2, 2), (True, True))
    with pytest.raises(ValueError, match="over 3 ranks"):
        plan.check_fits([2], 3)
    plan.check_fits([2], 2)


def test_policy_is_validated_and_coerced():
    policy = ShardPolicy(
        rule="torch", local_order="rule", layout="per_param", transport="broadcast"
    )
    assert policy.rule is Rule.TORCH and policy.layout is Layout.PER_PARAM
    with pytest.raises(ValueError) as info:
        ShardPolicy(layout="diagonal")
    assert info.value.args[0] == BAD_POLICY.format(
        field="layout", allowed=[m.value for m in Layout], value="diagonal"
    )
    with pytest.raises(TypeError, match="aligned"):
        ShardPolicy(aligned="yes")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        policy.rule = Rule.FAIRSCALE  # type: ignore[misc]


def test_the_policy_keeps_its_public_path_in_plan():
    """``oss_plus.planning.plan.ShardPolicy`` (the documented path, the adapters' and users' import)
    is the class :mod:`oss_plus.planning.policy` defines, not a copy."""
    for name in ("ShardPolicy", "LocalOrder", "Layout"):
        assert name in plan_module.__all__
    assert plan_module.ShardPolicy is ShardPolicy
    assert (plan_module.LocalOrder, plan_module.Layout) == (LocalOrder, Layout)


# ------------------------------------------------------------------ the contract rule
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "oss_plus"


def _private_members_of_oss() -> set[str]:
    """Underscore names OSS defines in optimizer.py (methods and ``self._x`` attributes)."""
    tree = ast.parse((PACKAGE / "optimizer.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
            names.add(node.name)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
        ):
            names.add(node.attr)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def test_no_module_but_optimizer_touches_an_underscore_member_of_oss():
    private = _private_members_of_oss()
    assert {"_shard", "_replanner", "_driver", "_policy"} <= private  # the scan works
    offenders = []
    roots = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "compat"]
    for root in roots:
        for path in root.rglob("*.py"):
            if path == PACKAGE / "optimizer.py" or path == pathlib.Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in private:
                    offenders.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.attr}"
                    )
    assert not offenders, "use the OSS contract instead of its private members:\n" + "\n".join(
        offenders
    )
