"""Muon at scale (issue 49, item 5): the Newton-Schulz cost, its sum per rank under each rule,
the muon rule inside ``OSS``, and ``oss-plus plan --optimizer muon``.

References are independent of the code under test: FLOPs counted by
``torch.utils.flop_counter`` around the real ``torch.optim.Muon.step()``, state bytes held by
the real optimizer, owners found by a greedy and an exhaustive search written here, the
unsharded ``torch.optim.Muon``.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import catch
from torch.utils.flop_counter import FlopCounterMode

from oss_plus import OSS
from oss_plus.cli import main
from oss_plus.planning import (
    MUON_STATE,
    ParamSpec,
    assign_owners,
    cost_rows,
    model_specs,
    ns_flops,
    rank_flops,
    specs_from_shapes,
    split_for_muon,
)
from oss_plus.planning.model_specs import EMBEDDINGS
from oss_plus.planning.muon import FLAT_NOT_MUON, recommendation

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without Muon")


def _macs(m: int, n: int, steps: int = 5) -> int:
    """Multiply-adds of ``steps`` iterations, product by product, on the short side first."""
    s, l = min(m, n), max(m, n)  # noqa: E741 - the issue's names
    gram, square, update = s * l * s, s * s * s, s * s * l  # X X^T, A A, B X
    return steps * (gram + square + update)


# ------------------------------------------------------------------ the cost
def test_the_cost_of_a_small_matrix_by_hand():
    # 2 x 3: s = 2, l = 3; per iteration X X^T 12, A A 8, B X 12 multiply-adds: 32
    assert _macs(2, 3) == 160 == 5 * 2**2 * (2 * 3 + 2)  # the issue's 5 s^2 (2l + s)
    assert ns_flops((2, 3)) == ns_flops((3, 2)) == 2 * 160
    assert ns_flops((7,)) == ns_flops((2, 3, 4)) == 0
    assert ns_flops((4, 4), steps=1) == 2 * _macs(4, 4, 1)


@pytest.mark.parametrize("shape", [(5, 12), (12, 5), (8, 8)])
def test_the_cost_is_what_torch_counts_in_a_real_muon_step(shape):
    param = torch.nn.Parameter(torch.randn(shape))
    param.grad = torch.randn(shape)
    opt = torch.optim.Muon([param], lr=0.02)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    assert counter.get_total_flops() == ns_flops(shape)


def test_muon_state_is_what_the_real_optimizer_holds():
    shapes = [(5, 12), (8, 8), (3, 7)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = torch.optim.Muon(params, lr=0.02)
    opt.step()
    held = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert held == MUON_STATE.rank_bytes(math.prod(s) for s in shapes)


# ------------------------------------------------------------------ per rank
SHAPES = [(4, 64), (16, 16), (2, 128), (8, 32), (32, 8), (1, 200), (12, 12)]


def _greedy(weights, order, ranks):
    """The first rank with the smallest total takes each param, in ``order``."""
    totals, owners = [0] * ranks, [0] * len(weights)
    for i in order:
        rank = totals.index(min(totals))
        owners[i], totals[rank] = rank, totals[rank] + weights[i]
    return owners


def _sums(owners, ranks):
    sums = [0] * ranks
    for (m, n), owner in zip(SHAPES, owners):
        sums[owner] += 2 * _macs(m, n)
    return sums


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_sum_per_rank_under_every_rule(ranks):
    specs = specs_from_shapes(SHAPES)
    numels = [m * n for m, n in SHAPES]
    flops = [2 * _macs(m, n) for m, n in SHAPES]
    by_size = sorted(range(len(SHAPES)), key=lambda i: -numels[i])
    by_cost = sorted(range(len(SHAPES)), key=lambda i: -flops[i])
    expected = {
        "fairscale": _greedy(numels, range(len(SHAPES)), ranks),
        "torch": _greedy(numels, by_size, ranks),
        "muon": _greedy(flops, by_cost, ranks),
    }
    for rule, owners in expected.items():
        assert assign_owners([specs], ranks, rule)[0] == owners, rule
        assert rank_flops(specs, ranks, rule) == _sums(owners, ranks), rule


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_muon_rule_is_within_grahams_bound_of_the_best_placement(ranks):
    """Longest-processing-time greedy: at most (4/3 - 1/(3N)) x the optimum, which an
    exhaustive search over every placement finds; here it beats both element rules."""
    specs = specs_from_shapes(SHAPES)
    best = min(
        max(_sums(owners, ranks)) for owners in itertools.product(range(ranks), repeat=len(SHAPES))
    )
    muon = max(rank_flops(specs, ranks, "muon"))
    assert best <= muon <= (4 / 3 - 1 / (3 * ranks)) * best
    assert muon < min(max(rank_flops(specs, ranks, r)) for r in ("fairscale", "torch"))


def test_frozen_and_shapeless_specs_weigh_as_under_the_fairscale_rule():
    frozen = ParamSpec(100, trainable=False, shape=(10, 10))
    assert [assign_owners([[ParamSpec(6, shape=(2, 3)), frozen, ParamSpec(5)]], 2, "muon")] == [
        [[0, 1, 1]]
    ]  # 320 FLOPs, then 5 elements, then the frozen one (weighs 1)
    with pytest.raises(ValueError, match="does not hold numel=6"):
        ParamSpec(6, shape=(2, 4))


# ------------------------------------------------------------------ realistic models
def _ratios(name, ranks):
    split = split_for_muon(model_specs(name), EMBEDDINGS[name])
    return {r.rule: round(r.ratio, 3) for r in cost_rows(split, [ranks])}


def test_the_issue_numbers_on_llama2_7b_at_128_ranks():
    assert _ratios("llama2-7b", 128) == {"fairscale": 1.590, "torch": 1.205, "muon": 1.205}


def test_the_muon_rule_beats_both_on_llama2_70b():
    assert _ratios("llama2-70b", 128) == {"fairscale": 1.384, "torch": 1.070, "muon": 1.011}
    assert _ratios("llama2-70b", 256) == {"fairscale": 1.504, "torch": 1.277, "muon": 1.171}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    split = split_for_muon(model_specs("llama2-7b"), EMBEDDINGS["llama2-7b"])
    assert len(split.hidden) == 32 * 7 and len(split.others) == 32 * 2 + 3
    assert sum(s.numel for s in split.others) == 2 * 32000 * 4096 + 65 * 4096
    gpt2 = split_for_muon(model_specs("gpt2-xl"), EMBEDDINGS["gpt2-xl"])
    assert {s.shape for s in gpt2.others if len(s.shape) == 2} == {(50257, 1600), (1024, 1600)}
    assert len(split_for_muon(specs_from_shapes([(4, 4), (4,)])).hidden) == 1  # --shapes: all 2-D
    with pytest.raises(ValueError, match="Muon would step nothing"):
        split_for_muon(specs_from_shapes([(4, 4), (4,)]), [0])


def test_the_recommendation_names_every_tied_rule():
    split = split_for_muon(model_specs("llama2-7b"), EMBEDDINGS["llama2-7b"])
    assert recommendation(cost_rows(split, [128]), 128) == (
        'for Muon over 128 ranks use partition_rule="torch" or "muon" (max/mean 1.205x; '
        "fairscale 1.590x)"
    )


# ------------------------------------------------------------------ the command
def _plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    return out


def test_plan_reports_flops_and_bytes_per_rule(capsys):
    topology = ["--nodes", "16", "--per-node", "8", "--shard-sizes", "8"]
    rules = ["--optimizer", "muon", "--rules", "fairscale,torch,muon,flat"]
    out = _plan(capsys, "--model", "llama2-7b", *topology, *rules)
    lines = out.splitlines()
    assert "torch.optim.Muon on 224 hidden 2-D matrices (6,476,005,376 elements)" in lines[1]
    assert "on the other 67 trainable params" in lines[1]
    assert lines[2] == FLAT_NOT_MUON
    # DDP holds all of it: 4 B per hidden element, AdamW 8 B per element and 4 B per tensor
    hidden, others = 6_476_005_376, 262_410_240
    ddp = next(line.split() for line in lines if line.startswith("ddp"))
    assert ddp[5] == f"{(4 * hidden + 8 * others + 4 * 67) / 1e9:,.2f}"
    start = next(i for i, line in enumerate(lines) if line.startswith("Newton-Schulz")) + 2
    table = [line.split() for line in lines[start : start + 6]]
    assert [(r[0], r[1], r[4]) for r in table] == [
        ("fairscale", "128", "1.590"), ("torch", "128", "1.205"), ("muon", "128", "1.205"),
        ("fairscale", "8", "1.024"), ("torch", "8", "1.000"), ("muon", "8", "1.000"),
    ]  # fmt: skip
    total = sum(
        2 * _macs(*s.shape) for s in split_for_muon(model_specs("llama2-7b"), (0, -1)).hidden
    )
    assert table[1][3] == f"{total / 128 / 1e12:,.3f}"  # the mean
    assert lines[-1].startswith('for Muon over 128 ranks use partition_rule="torch" or "muon"')


def test_plan_json_for_muon(capsys):
    topology = ["--nodes", "16", "--per-node", "8", "--shard-sizes", "8"]
    out = _plan(capsys, "--model", "llama2-70b", *topology, "--optimizer", "muon", "--json")
    report = json.loads(out)
    at_world = {
        r["rule"]: round(r["ratio"], 3) for r in report["newton_schulz"] if r["ranks"] == 128
    }
    assert at_world == {"fairscale": 1.384, "torch": 1.070, "muon": 1.011}
    assert report["recommendation"].startswith('for Muon over 128 ranks use partition_rule="muon"')


def tiny_lm():
    """A factory for ``--module``: embedding, two hidden matrices, a norm, an untied head."""
    return torch.nn.Sequential(
        torch.nn.Embedding(100, 16),
        torch.nn.Linear(16, 32, bias=False),
        torch.nn.Linear(32, 16, bias=False),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 100, bias=False),
    )


def test_plan_leaves_a_modules_embedding_and_head_to_adamw(capsys):
    topology = ["--nodes", "1", "--per-node", "2", "--optimizer", "muon"]
    out = _plan(capsys, "--module", "test_muon_plan:tiny_lm", *topology)
    assert "torch.optim.Muon on 2 hidden 2-D matrices (1,024 elements)" in out
    assert "on the other 4 trainable params" in out and "3,232 elements" in out
    assert main(["plan", "--module", "test_muon_plan:tiny_lm", *topology, "--rules", "flat"]) == 2
    assert FLAT_NOT_MUON in capsys.readouterr().err


# ------------------------------------------------------------------ the rule inside OSS
MATRICES = [(4, 24), (10, 10), (2, 40), (8, 12)]  # torch's order (by size) is not the cost's


def muon_rule_task(ctx):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in MATRICES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OSS(params, optim=torch.optim.Muon, group=ctx.group, partition_rule="muon", lr=0.02)
    plain = torch.optim.Muon(ref, lr=0.02)
    for step in range(3):
        for ps, o in ((params, opt), (ref, plain)):
            gen = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            o.step()
    ids = [id(p) for p in params]
    mine = [ids.index(id(p)) for g in opt.optim.param_groups for p in g["params"]]
    exact = all(torch.equal(a, b) for a, b in zip(params, ref))
    flat = catch(OSS, params, optim=torch.optim.Muon, group=ctx.group, partition_rule="flat")
    return sorted(mine), exact, flat


def test_the_muon_rule_steps_exactly_like_plain_muon(pool):
    flops = [ns_flops(s) for s in MATRICES]
    owners = _greedy(flops, sorted(range(4), key=lambda i: -flops[i]), 2)
    results = pool.run(muon_rule_task, world_size=2)
    for rank, (mine, exact, flat) in enumerate(results):
        assert mine == [i for i, o in enumerate(owners) if o == rank]
        assert exact  # bit for bit with the unsharded Muon, on every replica
        assert flat[0] == "ValueError" and "elementwise" in flat[1]
    assert owners != assign_owners([specs_from_shapes(MATRICES)], 2, "torch")[0]
