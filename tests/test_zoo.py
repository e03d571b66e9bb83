"""The ecosystem's optimizers inside OSS, through every state path, under each partition rule
(issue 49, item 4), against the same optimizer unsharded.

Each optimizer of :data:`zoo.ZOO` (schedule-free ones in train mode, Muon on a model of
matrices) runs the harness of tests/state_paths.py: trained at 2 ranks, consolidated to one
rank and to all, handed to the plain class through ``torch.save``, saved as sharded,
consolidated and asynchronous safetensors checkpoints and through torch DCP with three option
sets, and resumed from each at 2, 3 and 1 ranks; every resume must hold the state the plain
optimizer's ``torch.save``/``torch.load`` gives (values, strides, storage sharing) and go on
bit for bit as the unsharded run. The rules: OSS's default (the fairscale rule, oss_plus's
layout), fairscale's own policy (``oss_plus.compat.fairscale.FAIRSCALE_POLICY``: its local
order and buckets) and the torch rule. Optimizers that read across params (Prodigy,
D-Adaptation) are refused instead: tests/test_cross_param.py. Verdicts: docs/optimizers.md.
"""

from __future__ import annotations

import pytest
import zoo
from state_paths import Case, every_path_task, expected_paths

from oss_plus.compat.fairscale import FAIRSCALE_POLICY

#: OSS keyword arguments of each rule.
RULES = {
    "default": {},
    "fairscale": {"shard_policy": FAIRSCALE_POLICY},
    "torch": {"partition_rule": "torch"},
}


def case_of(name: str, rule: str) -> Case:
    entry = zoo.ZOO[name]
    extra = {"model": zoo.matrices_model} if entry.matrices_only else {}
    return Case(
        f"{name} ({rule} rule)",
        entry.make,
        entry.normalize,
        context=zoo.eager,
        oss={**RULES[rule], **entry.oss},
        refused=entry.refused,
        **extra,
    )


def _runs() -> list:
    """(name, rule) pytest params: every rule, or the default only (``Zoo.all_rules``)."""
    return [
        pytest.param(p.values[0], rule, id=f"{p.id}-{rule}", marks=p.marks)
        for rule in RULES
        for p in zoo.params(paths=True)
        if rule == "default" or zoo.ZOO[p.values[0]].all_rules
    ]


@pytest.mark.parametrize(("name", "rule"), _runs())
def test_every_state_path_matches_the_unsharded_optimizer(pool, tmp_path, name, rule):
    case = case_of(name, rule)
    got = pool.run(every_path_task, case, str(tmp_path), world_size=3, timeout=300)
    assert got == expected_paths(case.refused)
