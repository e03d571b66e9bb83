"""Optimizer-state bytes of low-bit optimizers: the counter, the planning table against the real
optimizers, ``oss-plus bench --state-memory`` tiny, and ``oss-plus plan --optimizer``.

torchao compiles its step per shape (minutes here); ``TORCHDYNAMO_DISABLE=1`` runs it eagerly
with the same state (the state is made outside the compiled function)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from types import SimpleNamespace

import pytest
import torch

from oss_plus.bench import state_memory
from oss_plus.bench.state_count import count_state, storage_bytes
from oss_plus.cli import main
from oss_plus.planning import OPTIMIZER_STATES, model_specs
from oss_plus.planning.report import OPTIMIZER_NEEDS_TOPOLOGY, OPTIMIZER_OR_STATE_BYTES


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # read at each torch.compile call


# ------------------------------------------------------------------ the counter
def test_counter_counts_distinct_storages_of_plain_state():
    """A hand-built state: a tensor and its view count one storage; a table shared by two
    params counts once; a Python int counts nothing; a uint8 state is low-bit."""
    shared = torch.zeros(256)  # 1024 B
    m = torch.zeros(10, 10)  # 400 B
    small = torch.zeros(3)
    p1, p2, p3 = torch.zeros(10, 10), torch.zeros(4096), torch.zeros(3)
    state = {
        p1: {"step": 3, "exp_avg": m, "view": m[2:, :5]},
        p2: {"codes": torch.zeros(4096, dtype=torch.uint8), "qmap": shared},
        p3: {"exp_avg": small, "qmap": shared},
    }
    count = count_state(SimpleNamespace(state=state))
    assert count.total == 400 + (4096 + 1024) + 12
    assert (count.tensors, count.full, count.full_numel) == (3, 2, 103)
    assert count.full_bytes == 400 + 12  # the shared table was first counted at p2


def test_counter_takes_tensor_subclasses_apart():
    """torchao's OptimState8bit made from known parts: codes + scales + its lookup table, where
    ``numel() * element_size()`` would say fp32."""
    subclass = pytest.importorskip("torchao.optim.subclass_8bit")
    codes, scale = torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(16)
    qmap = torch.zeros(256)
    state8 = subclass.OptimState8bit(codes, scale, qmap, signed=True, dtype=torch.float32)
    assert state8.numel() * state8.element_size() == 4 * 4096  # what a naive count says
    assert storage_bytes(state8) == 4096 + 16 * 4 + 256 * 4
    assert storage_bytes([state8, state8, codes]) == 4096 + 16 * 4 + 256 * 4  # each part once
    p = torch.zeros(64, 64)
    count = count_state(SimpleNamespace(state={p: {"exp_avg": state8}}))
    assert (count.total, count.full) == (4096 + 64 + 1024, 0)


# ------------------------------------------------------------------ the planning table
#: Sizes around every threshold: fp32 under 4096, whole torchao blocks (256, 128), a partial
#: bitsandbytes block (5000), a 2-D weight.
SIZES = [(100,), (4000,), (4096,), (4224,), (5000,), (64, 1000), (256, 256)]


def _real(name: str) -> type:
    module, cls, _ = state_memory.OPTIMIZERS[name]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} is not installed")
    return getattr(importlib.import_module(module), cls)


@pytest.mark.parametrize("name", list(OPTIMIZER_STATES))
def test_the_planning_table_is_what_the_real_optimizer_holds(name, eager):
    """Per tensor and for all tensors in one optimizer (a table shared by every tensor counts
    once), the table's bytes equal the state the real optimizer holds after a step."""
    cls, kwargs = _real(name), state_memory.OPTIMIZERS[name][2]
    layout = OPTIMIZER_STATES[name]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SIZES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = cls(params, lr=1e-3, **kwargs)
    opt.step()
    numels = [math.prod(s) for s in SIZES]
    assert count_state(opt).total == layout.rank_bytes(numels)
    for p, n in zip(params, numels):
        alone = cls([p], lr=1e-3, **kwargs)
        alone.step()
        assert count_state(alone).total == layout.rank_bytes([n]), (name, n)
        assert count_state(alone).full == (not layout.quantized(n)), (name, n)


def test_bench_rows_are_the_planning_table():
    assert set(state_memory.OPTIMIZERS) == set(OPTIMIZER_STATES)


# ------------------------------------------------------------------ the bench, tiny
@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """``bench --state-memory`` on a width-64 model at 2 ranks (eager torchao)."""
    out = tmp_path_factory.mktemp("state_memory")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        printed = io.StringIO()
        argv = ["bench", "--state-memory", "--width", "64", "--sweep-worlds", "2"]
        with contextlib.redirect_stdout(printed):
            code = main([*argv, "--impls", "adamw,adamw8bit,bnb-adamw8bit", "--out", str(out)])
    return code, json.loads((out / "state_memory.json").read_text()), printed.getvalue()


def test_bench_counts_each_rank_as_planned_and_low_bit_is_a_quarter(tiny_bench):
    code, data, text = tiny_bench
    assert code == 0
    rows = {(r["optimizer"], r["world"]): r for r in data["rows"]}
    names = ["adamw"] + [n for n in ("adamw8bit", "bnb-adamw8bit") if n not in data["skipped"]]
    assert set(rows) == {(n, w) for n in names for w in (1, 2)}
    params = sum(p.numel() for p in state_memory.build_model(64).parameters())
    # AdamW: 8 B per element and a 4-byte step per tensor, split over the ranks
    assert rows["adamw", 1]["ranks"][0]["total"] == 8 * params + 4 * 52
    assert sum(c["total"] for c in rows["adamw", 2]["ranks"]) == 8 * params + 4 * 52
    for (name, world), row in rows.items():
        assert len(row["ranks"]) == world
        assert row["planned"] == [c["total"] for c in row["ranks"]], (name, world)
        if name != "adamw":
            most = max(c["total"] for c in row["ranks"])
            adamw = max(c["total"] for c in rows["adamw", world]["ranks"])
            assert 0.2 < most / adamw < 0.3, (name, world, most / adamw)
            assert row["ranks"][0]["full"] > 0  # the biases and norms keep fp32 state
    assert "x adamw" in text and "exact" in text


def test_missing_packages_are_skipped_with_a_line(monkeypatch, eager):
    ghost = ("not_a_real_package_x.optim", "AdamW8bit", {})
    monkeypatch.setitem(state_memory.OPTIMIZERS, "bnb-adamw8bit", ghost)
    rows, skipped = state_memory.measure(("adamw", "bnb-adamw8bit"), (), 16)
    assert [r["optimizer"] for r in rows] == ["adamw"]
    text = state_memory.table(rows, skipped, 16)
    assert "skipped bnb-adamw8bit: not_a_real_package_x is not installed" in text


def test_bench_refuses_an_unknown_optimizer(capsys):
    assert main(["bench", "--state-memory", "--impls", "lion"]) == 2
    assert "unknown --impls ['lion'] for --state-memory" in capsys.readouterr().err


# ------------------------------------------------------------------ oss-plus plan --optimizer
def _plan_json(capsys, *flags: str) -> dict:
    argv = ["plan", "--model", "llama2-7b", "--nodes", "1", "--per-node", "8", "--json"]
    assert main([*argv, "--rules", "fairscale", "--shard-sizes", "8", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_counts_llama_state_tensor_by_tensor(capsys):
    """Llama-2 7B's 291 tensors are all >= 4096 elements and whole 256-blocks: 8-bit state is
    2 B + 2 fp32 scales per 256 elements, two 256-entry tables and a step per tensor."""
    elements = sum(s.numel for s in model_specs("llama2-7b"))
    rows = {r["stage"]: r for r in _plan_json(capsys, "--optimizer", "adamw8bit")["rows"]}
    assert rows["ddp"]["state"] == 2 * elements + 2 * 4 * elements // 256 + 291 * (2048 + 4)
    plain = {r["stage"]: r for r in _plan_json(capsys, "--optimizer", "adamw")["rows"]}
    assert plain["ddp"]["state"] == 8 * elements + 4 * 291
    ratio = rows["zero1"]["state"] / plain["zero1"]["state"]
    assert 0.25 < ratio < 0.26
    default = {r["stage"]: r for r in _plan_json(capsys)["rows"]}
    assert default["ddp"]["state"] == 8 * elements  # --state-bytes 8, as before


def test_plan_shows_no_flat_rows_for_a_block_quantized_optimizer(capsys):
    """OSS refuses block-quantized optimizers under the flat rule: plan says so instead."""
    argv = ["plan", "--model", "llama2-7b", "--nodes", "1", "--per-node", "8", "--rules"]
    assert main([*argv, "fairscale,flat", "--optimizer", "adamw8bit"]) == 0
    out = capsys.readouterr().out
    assert "OSS refuses adamw8bit under partition_rule='flat'" in out
    assert not [line for line in out.splitlines() if line.split()[1:2] == ["flat"]]
    assert main([*argv, "flat", "--optimizer", "adamw", "--json"]) == 0
    assert {r["rule"] for r in json.loads(capsys.readouterr().out)["rows"]} >= {"flat"}


def test_plan_names_the_optimizer_and_refuses_both_flags(capsys):
    argv = ["plan", "--model", "llama2-7b", "--nodes", "1", "--per-node", "8"]
    assert main([*argv, "--optimizer", "bnb-adamw8bit"]) == 0
    out = capsys.readouterr().out
    assert "bnb-adamw8bit state" in out.splitlines()[0]
    assert "state: bitsandbytes.optim.AdamW8bit" in out
    assert main([*argv, "--optimizer", "adamw8bit", "--state-bytes", "2"]) == 2
    err = capsys.readouterr().err
    assert OPTIMIZER_OR_STATE_BYTES.format(name="adamw8bit", state_bytes=2) in err
    assert "drop --state-bytes 2" in err and "topology" not in err  # the user gave one


@pytest.mark.parametrize("name", ["adamw8bit", "muon"])
def test_plan_with_an_optimizer_and_no_topology_names_the_flags_to_add(capsys, name):
    assert main(["plan", "--model", "llama2-7b", "--optimizer", name]) == 2
    err = capsys.readouterr().err
    assert OPTIMIZER_NEEDS_TOPOLOGY.format(name=name) in err
    assert "add --nodes N --per-node G" in err and "--state-bytes" not in err  # not given
    # what the message offers instead runs: the balance table (Muon's rule by --rules)
    assert main(["plan", "--model", "llama2-7b", "--rules", "muon", "--world-sizes", "8"]) == 0
    assert main(["plan", "--model", "llama2-7b", "--optimizer", name, "--nodes", "1",
                 "--per-node", "8"]) == 0  # fmt: skip
