"""``oss-plus plan --nodes N --per-node G`` (issue 38, item 3): the per-stage arithmetic
against closed forms (DDP's ring all-reduce, FSDP's HYBRID_SHARD) and against the bytes of
the collectives a few gloo ranks actually launch for a small model.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel
from oss_plus.cli import main
from oss_plus.planning.model_specs import model_specs
from oss_plus.planning.scale import Topology, scale_rows

P7B = 6_738_415_616


def _rows(specs, nodes, per_node, rules=("flat",), sizes=(8,), backend="nccl"):
    rows = scale_rows(specs, Topology(nodes, per_node), rules, sizes, backend=backend)
    return {(r.stage, r.rule, r.shard): r for r in rows}


# ----------------------------------------------------------------- closed forms
@pytest.mark.parametrize("nodes", [8, 64])
def test_ddp_is_the_ring_all_reduce_and_zero2_moves_as_much(nodes):
    world = nodes * 8
    rows = _rows(model_specs("llama2-7b"), nodes, 8)
    ddp = rows["ddp", "-", 1]
    assert ddp.inter == pytest.approx(2 * (world - 1) / world * P7B * 4) and ddp.intra == 0
    zero2 = rows["zero2", "flat", world]
    assert zero2.inter == pytest.approx(ddp.inter, rel=1e-6)  # reduce-scatter + all-gather
    assert zero2.grads == pytest.approx(P7B * 4 / world, rel=1e-6)
    assert zero2.state == pytest.approx(P7B * 8 / world, rel=1e-6)
    zero1 = rows["zero1", "flat", world]
    assert zero1.inter == pytest.approx(1.5 * ddp.inter, rel=1e-6)  # docs/performance.md


@pytest.mark.parametrize("nodes", [8, 64])
def test_hybrid_sends_one_shard_of_the_gradients_across_nodes(nodes):
    """Hybrid ZeRO-2, shard group = the node: across nodes each rank all-reduces 1/S of
    the gradient bytes over the W/S replicas; FSDP HYBRID_SHARD sends the same across nodes
    and gathers the parameters twice inside the node."""
    replicas, shard = nodes, 8
    rows = _rows(model_specs("llama2-7b"), nodes, 8)
    hybrid = rows["hybrid-zero2", "flat", shard]
    across = 2 * (replicas - 1) / replicas * P7B * 4 / shard
    assert hybrid.inter == pytest.approx(across, rel=1e-6)
    assert hybrid.intra == pytest.approx(2 * (shard - 1) / shard * P7B * 4, rel=1e-6)
    fsdp = rows["fsdp-hybrid", "-", shard]
    assert fsdp.inter == pytest.approx(across, rel=1e-6)
    assert fsdp.intra == pytest.approx(3 * (shard - 1) / shard * P7B * 4, rel=1e-6)
    assert fsdp.params == pytest.approx(P7B * 4 / shard, rel=1e-6)


def test_one_node_sends_nothing_between_nodes():
    rows = scale_rows([1000] * 50, Topology(1, 8), ["fairscale", "flat"], [2, 4])
    assert all(r.inter == 0 for r in rows) and all(r.intra > 0 for r in rows)


def test_whole_param_rule_is_broadcast_where_a_gather_would_carry_w_times_the_largest():
    """An embedding of 32000 x 4096 at 512 ranks: the all_gather region would be the
    embedding, 512 x 131M x 4 B; the sync sends (W-1)/W of the total instead."""
    rows = _rows(model_specs("llama2-7b"), 64, 8, rules=("torch",))
    zero1, ddp = rows["zero1", "torch", 512], rows["ddp", "-", 1]
    assert zero1.inter - ddp.inter == pytest.approx(511 / 512 * P7B * 4, rel=1e-3)


def test_bad_shard_size_and_topology_raise_naming_the_fix():
    with pytest.raises(ValueError, match="does not divide the world of 64 ranks"):
        scale_rows([10], Topology(8, 8), ["flat"], [3])
    with pytest.raises(ValueError, match="--nodes and --per-node must both be"):
        Topology(0, 8)


def test_the_command_prints_every_stage(capsys):
    argv = ["plan", "--model", "llama2-7b", "--nodes", "8", "--per-node", "8", "--json"]
    assert main([*argv, "--shard-sizes", "8,16"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    stages = {(r["stage"], r["shard"]) for r in rows}
    assert {("hybrid-zero2", 8), ("hybrid-zero2", 16), ("fsdp-hybrid", 16)} <= stages
    assert main(["plan", "--model", "llama2-7b", "--nodes", "8"]) == 2


# ----------------------------------------------------------------- bytes counted on gloo
_WEIGHT = {"reduce": 1, "broadcast": 1, "reduce_scatter_tensor": 1, "all_reduce": 2}


class _Counted:
    """Bytes one rank sends in the ring algorithm of every collective launched inside the
    block: (n - 1) / n of each reduce / broadcast / reduce-scatter input, twice that for an
    all-reduce."""

    def __init__(self, world: int) -> None:
        self.world, self.sent, self.saved = world, 0.0, {}

    def __enter__(self) -> _Counted:
        for name, weight in _WEIGHT.items():
            self.saved[name] = original = getattr(dist, name)

            def counted(*args, _w=weight, _f=original, _n=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
                tensor = args[1] if _n == "reduce_scatter_tensor" else args[0]
                share = (self.world - 1) / self.world * tensor.numel() * tensor.element_size()
                self.sent += _w * share
                return _f(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 50), torch.nn.Linear(50, 3)
    )


def counted_task(ctx, rule):
    world = ctx.world_size
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(ctx.rank))
    model = _model()
    ddp = DDP(_model(), process_group=ctx.group)
    all_reduced = [0.0]

    def hook(state, bucket):  # noqa: ANN001, ANN202
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        buffer = bucket.buffer()
        all_reduced[0] += 2 * (world - 1) / world * buffer.numel() * buffer.element_size()
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(ctx.group, hook)
    ddp(x).sum().backward()
    opt = OSS(
        model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, partition_rule=rule
    )
    sdp = ShardedDataParallel(model, opt, ctx.group, find_unused_parameters=False)
    sdp(x).sum().backward()  # the first backward records the order
    opt.step()
    opt.zero_grad()
    loss = sdp(x).sum()
    with _Counted(world) as backward:
        loss.backward()
    with _Counted(world) as step:
        opt.step()
    return {"ddp": all_reduced[0], "reduce": backward.sent, "sync": step.sent}


@pytest.mark.parametrize("rule", ["fairscale", "flat"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_plan_predicts_the_bytes_counted_on_gloo(pool, world, rule):
    """DDP's all-reduce, ZeRO-1 (all-reduce + sync) and ZeRO-2 (reduce + sync) as the plan
    computes them for this model on one node of ``world`` gloo ranks, against the bytes of the
    collectives launched; the layouts add alignment padding and status slots (at most 16
    elements per param and 2 per bucket, each way)."""
    numels = [p.numel() for p in _model().parameters()]
    rows = _rows(numels, 1, world, rules=(rule,), sizes=(), backend="gloo")
    slack = 4 * (16 * len(numels) + 2 * 8) * 2
    for r in pool.run(counted_task, rule, world_size=world):
        assert r["ddp"] == pytest.approx(rows["ddp", "-", 1].intra, rel=1e-9)
        zero1 = rows["zero1", rule, world].intra
        assert abs(r["ddp"] + r["sync"] - zero1) <= slack, (r, zero1)
        zero2 = rows["zero2", rule, world].intra
        assert abs(r["reduce"] + r["sync"] - zero2) <= slack, (r, zero2)
        assert slack < 0.1 * zero2


def test_the_tables_of_docs_partition_are_the_commands_output(capsys):
    """Every ``$ oss-plus plan ... --nodes`` block of docs/hybrid.md and docs/partition.md is
    what the command prints now."""
    from pathlib import Path

    docs = Path(__file__).parent.parent / "docs"
    text = (docs / "hybrid.md").read_text() + (docs / "partition.md").read_text()
    blocks = [b for b in text.split("```\n$ oss-plus plan ")[1:]]
    assert len(blocks) == 2  # Adam at 64 x 8 (hybrid.md); Muon + AdamW at 16 x 8 (partition.md)
    for block in blocks:
        command, printed = block.split("```")[0].split("\n", 1)
        assert main(["plan", *command.split()]) == 0
        assert capsys.readouterr().out.strip() == printed.strip(), command
