"""The partition balance report and ``oss-plus plan`` (pure: no processes)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from oss_plus.cli import main
from oss_plus.planning import report as plan_report
from oss_plus.planning.partition import ParamSpec
from oss_plus.planning.report import (
    FLAT_ALIGN,
    BalanceRow,
    balance_rows,
    model_specs,
    parse_shapes,
    read_shapes,
    specs_from_module,
)

WORLDS = [8, 64, 256, 1024]
RULES = ["fairscale", "torch", "flat"]
#: Published parameter counts (Hugging Face configs of the released checkpoints) and the
#: number of distinct parameter tensors (tied GPT-2 lm_head counted once).
PUBLISHED = {
    "llama2-7b": (6_738_415_616, 291),
    "llama2-70b": (68_976_648_192, 723),
    "gpt2-xl": (1_557_611_200, 580),
}


# ------------------------------------------------------------------ independent references
def greedy_loads(numels: list[int], world: int, rule: str) -> list[int]:
    """The whole-tensor rules, written again: each tensor to the first least-loaded rank,
    in the given order (fairscale) or largest first, stable (torch); all trainable."""
    order = sorted(numels, key=lambda n: -n) if rule == "torch" else numels
    loads = [0] * world
    for n in order:
        loads[loads.index(min(loads))] += n
    return loads


def run(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *map(str, argv)])
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ built-in models
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_built_in_models_match_the_published_parameter_counts(name):
    specs = model_specs(name)
    total, tensors = PUBLISHED[name]
    assert sum(s.numel for s in specs) == total
    assert len(specs) == tensors and all(s.trainable for s in specs)


def test_built_in_shapes_follow_the_configs():
    llama70 = plan_report.MODELS["llama2-70b"]()
    assert llama70[:5] == [(32000, 8192), (8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192)]
    assert llama70[5:8] == [(28672, 8192), (28672, 8192), (8192, 28672)]
    assert llama70[-1] == (32000, 8192) and llama70.count((32000, 8192)) == 2  # untied
    gpt2 = plan_report.MODELS["gpt2-xl"]()
    assert gpt2[:2] == [(50257, 1600), (1024, 1600)] and gpt2.count((50257, 1600)) == 1  # tied
    assert gpt2.count((1600, 4800)) == gpt2.count((4800,)) == 48
    assert gpt2.count((1600, 6400)) == gpt2.count((6400, 1600)) == 48


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_flat_rule_is_within_one_percent_of_ideal_at_every_scale(name):
    specs = model_specs(name)
    total = PUBLISHED[name][0]
    rows = balance_rows(specs, WORLDS, RULES)
    assert [(r.rule, r.world_size) for r in rows] == [(r, n) for r in RULES for n in WORLDS]
    for row in rows:
        assert row.ideal == total / row.world_size
        if row.rule == "flat":
            assert row.ideal <= row.max_load <= 1.01 * row.ideal and row.empty == 0
        else:  # a whole tensor cannot be split: the largest one bounds the largest rank
            assert row.max_load >= max(s.numel for s in specs)
            loads = greedy_loads([s.numel for s in specs], row.world_size, row.rule)
            assert (row.max_load, row.empty) == (max(loads), loads.count(0))


def test_whole_tensor_rules_are_unbalanced_for_llama2_7b_at_1024_ranks():
    rows = balance_rows(model_specs("llama2-7b"), [1024], RULES)
    ratios = {r.rule: r.ratio for r in rows}
    assert ratios["fairscale"] > 1.5 and ratios["torch"] > 1.5
    # 291 tensors over 1024 ranks: at least 733 ranks hold nothing
    assert all(r.empty >= 1024 - 291 for r in rows if r.rule != "flat")
    embedding = 32000 * 4096
    assert ratios["torch"] == pytest.approx(embedding / (6_738_415_616 / 1024))


def test_flat_rule_uses_the_given_alignment_and_one_buffer():
    specs = parse_shapes("40")  # ranges of ceil(40 / 2) = 20 elements, rounded up to 16s
    (row,) = balance_rows(specs, [2], ["flat"])
    assert row.max_load == 32 and row.ideal == 20  # rank 0 holds [0, 32), rank 1 [32, 40)
    (row,) = balance_rows(specs, [2], ["flat"], align=1)
    assert row.max_load == 20
    (row,) = balance_rows(parse_shapes("10,10"), [2], ["flat"])  # offsets 0 and 16
    assert row.max_load == 10  # padding is no load: rank 0 holds param 0, rank 1 param 1
    mixed = [ParamSpec(10, key="a", align=2), ParamSpec(10, key="b", align=4)]
    (row,) = balance_rows(mixed, [2], ["flat"], align=1)  # keys and aligns are replaced
    assert row.max_load == 10


def test_frozen_params_carry_no_state_and_bad_inputs_are_refused():
    specs = [ParamSpec(100), ParamSpec(100, trainable=False)]
    rows = balance_rows(specs, [2], RULES)
    # whole tensors: one rank holds the trainable one; flat: cut at 64 (ranges of 16s)
    assert [(r.max_load, r.ideal, r.empty) for r in rows] == [(100, 50, 1)] * 2 + [(64, 50, 0)]
    with pytest.raises(ValueError, match="no trainable"):
        balance_rows([ParamSpec(4, trainable=False)], [2], RULES)
    with pytest.raises(ValueError, match=">= 1"):
        balance_rows(specs, [0], RULES)
    with pytest.raises(ValueError):
        balance_rows(specs, [2], ["zero3"])
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        model_specs("gpt5")


def test_row_as_dict_carries_the_ratio():
    row = BalanceRow("torch", 4, 30, 20.0, 1)
    assert row.ratio == 1.5
    assert row.as_dict() == {
        "rule": "torch",
        "world_size": 4,
        "max_load": 30,
        "ideal": 20.0,
        "empty": 1,
        "ratio": 1.5,
    }


# ------------------------------------------------------------------ shape parsers
def test_parse_shapes_reads_lists_lines_and_comments():
    specs = parse_shapes("4096x4096,4096\n 3x4x5  7 # a comment 9x9\n\n0")
    assert [s.numel for s in specs] == [4096 * 4096, 4096, 60, 7, 0]
    assert all(s.trainable for s in specs)


@pytest.mark.parametrize("text", ["4x", "x4", "4x-1", "4.5", "a", "4*4", "", " # only"])
def test_parse_shapes_refuses_what_is_not_a_shape(text):
    with pytest.raises(ValueError, match="4096x4096"):
        parse_shapes(text)


def test_read_shapes_from_text_and_json_files(tmp_path):
    text = tmp_path / "shapes.txt"
    text.write_text("# llama block\n4096x4096\n11008x4096, 4096\n")
    assert [s.numel for s in read_shapes(str(text))] == [4096**2, 11008 * 4096, 4096]
    data = tmp_path / "shapes.json"
    data.write_text(json.dumps([[16, 8], [8], []]))
    assert [s.numel for s in read_shapes(str(data))] == [128, 8, 1]
    assert [s.numel for s in read_shapes("2x3,4")] == [6, 4]


@pytest.mark.parametrize(
    "content, match",
    [
        ("[[4, 4], [-1]]", "non-negative"),
        ("[[4, true]]", "non-negative"),
        ("[[4, 4]", "not valid JSON"),
        ("[]", "JSON list"),
    ],
)
def test_read_shapes_names_a_bad_file(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as exc:
        read_shapes(str(path))
    assert str(path) in str(exc.value)


def test_read_shapes_of_a_missing_file_says_so(tmp_path):
    with pytest.raises(ValueError, match="is no file, and cannot read the shape"):
        read_shapes(str(tmp_path / "missing.txt"))


# ------------------------------------------------------------------ module loader
BUILT_ON: list[torch.device] = []


class Tiny(torch.nn.Module):
    """An embedding tied to the head, a trainable projection and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 3).requires_grad_(False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        BUILT_ON.append(self.proj.weight.device)


def tiny() -> torch.nn.Module:
    return Tiny()


def needs_real_values() -> torch.nn.Module:
    """Fails on the meta device (reads a value), works on the CPU."""
    model = torch.nn.Linear(2, 2)
    BUILT_ON.append(model.weight.device)
    model.weight.sum().item()
    return model


def not_a_module() -> int:
    return 3


def broken() -> torch.nn.Module:
    raise RuntimeError("factory bug")


def test_module_loader_builds_on_meta_counts_tied_once_and_reads_requires_grad():
    BUILT_ON.clear()
    specs = specs_from_module("test_plan_report:tiny")
    assert [d.type for d in BUILT_ON] == ["meta"]
    assert [(s.numel, s.trainable) for s in specs] == [
        (40, True),  # emb (and the tied head)
        (12, True),
        (3, True),
        (9, False),
        (3, False),
    ]
    assert [s.numel for s in specs_from_module("test_plan_report:Tiny")] == [40, 12, 3, 9, 3]


def test_module_loader_falls_back_to_a_real_build(caplog):
    BUILT_ON.clear()
    with caplog.at_level(logging.WARNING, logger="oss_plus.planning.model_specs"):
        specs = specs_from_module("test_plan_report:needs_real_values")
    assert [d.type for d in BUILT_ON] == ["meta", "cpu"]
    assert [s.numel for s in specs] == [4, 2] and "meta device" in caplog.text


@pytest.mark.parametrize(
    "spec, match",
    [
        ("test_plan_report", "package.module:factory"),
        (":tiny", "package.module:factory"),
        ("no_such_module_xyz:f", "No module named 'no_such_module_xyz'"),
        ("test_plan_report:missing", "has no attribute 'missing'"),
        ("test_plan_report:WORLDS", "is not callable"),
        ("test_plan_report:not_a_module", "returned int, expected a torch.nn.Module"),
        ("test_plan_report:broken", "RuntimeError: factory bug"),
    ],
)
def test_module_loader_errors_name_the_spec(spec, match):
    with pytest.raises(ValueError, match=match) as exc:
        specs_from_module(spec)
    assert repr(spec) in str(exc.value)


# ------------------------------------------------------------------ oss-plus plan
def table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rule", "N"])
    return [line.split() for line in lines[start + 1 :]]


def test_cli_table_for_llama2_7b(capsys):
    code, out, err = run(capsys, "--model", "llama2-7b")
    assert code == 0 and err == ""
    assert out.startswith("llama2-7b: 291 params, 6,738,415,616 elements, 6,738,415,616 trainable")
    rows = table_rows(out)
    assert [(r[0], int(r[1])) for r in rows] == [(r, n) for r in RULES for n in WORLDS]
    by_key = {(r[0], int(r[1])): r for r in rows}
    assert by_key[("flat", 8)][2:] == ["842,301,952", "842,301,952", "1.000", "0"]
    embedding = f"{32000 * 4096:,}"
    assert by_key[("torch", 1024)][3:] == [embedding, "19.918", "733"]
    fairscale = greedy_loads([s.numel for s in model_specs("llama2-7b")], 64, "fairscale")
    assert by_key[("fairscale", 64)][3] == f"{max(fairscale):,}"


def test_cli_json_for_shapes_and_selected_rules(capsys):
    code, out, _ = run(
        capsys,
        "--shapes",
        "100,60,40",
        "--world-sizes",
        "2,3",
        "--rules",
        "torch,flat",
        "--align",
        "1",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert {k: report[k] for k in ("source", "params", "elements", "trainable", "align")} == {
        "source": "100,60,40",
        "params": 3,
        "elements": 200,
        "trainable": 200,
        "align": 1,
    }
    got = [(r["rule"], r["world_size"], r["max_load"], r["empty"]) for r in report["rows"]]
    assert got == [
        ("torch", 2, 100, 0),
        ("torch", 3, 100, 0),
        ("flat", 2, 100, 0),
        ("flat", 3, 67, 0),
    ]
    assert report["rows"][3]["ratio"] == pytest.approx(67 / (200 / 3))


def test_cli_reads_a_shapes_file_and_a_module(capsys, tmp_path):
    path = tmp_path / "shapes.txt"
    path.write_text("8x8\n8\n")
    code, out, _ = run(capsys, "--shapes", path, "--world-sizes", "1", "--rules", "fairscale")
    assert code == 0 and table_rows(out) == [["fairscale", "1", "72", "72", "1.000", "0"]]
    code, out, _ = run(
        capsys,
        "--module",
        "test_plan_report:tiny",
        "--world-sizes",
        "2",
        "--rules",
        "fairscale",
        "--json",
    )
    report = json.loads(out)
    assert code == 0 and (report["elements"], report["trainable"]) == (67, 55)
    assert report["align"] == FLAT_ALIGN == 16
    assert report["rows"][0]["max_load"] == 40  # emb alone; proj weight + bias and frozen: 15


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "llama3"], "invalid choice: 'llama3'"),
        (["--model", "gpt2-xl", "--world-sizes", "8,0"], "every value must be >= 1"),
        (["--model", "gpt2-xl", "--world-sizes", "8,x"], "integers separated by commas"),
        (["--model", "gpt2-xl", "--rules", "flat,zero3"], "rules are among fairscale,torch"),
        (["--model", "gpt2-xl", "--shapes", "4"], "not allowed with argument"),
        ([], "one of the arguments --model --shapes --module is required"),
    ],
)
def test_cli_usage_errors_exit_2(capsys, argv, match):
    assert match in usage_error(capsys, *argv)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--shapes", "4096x4096,40g6"], "cannot read the shape '40g6'"),
        (["--module", "no_such_module_xyz:f"], "No module named 'no_such_module_xyz'"),
        (["--module", "test_plan_report:not_a_module"], "expected a torch.nn.Module"),
    ],
)
def test_cli_input_errors_are_one_line_and_exit_2(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("oss-plus plan: error: ") and match in err and err.count("\n") == 1


def test_published_totals_are_consistent_with_the_configs():
    """An independent check of the totals from the config formulas (not the shape lists)."""
    d, f, v, L = 4096, 11008, 32000, 32
    assert 2 * v * d + L * (4 * d * d + 3 * d * f + 2 * d) + d == PUBLISHED["llama2-7b"][0]
    d, f, kv, L = 8192, 28672, 1024, 80
    assert (
        2 * v * d + L * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + d
        == (PUBLISHED["llama2-70b"][0])
    )
    d, L = 1600, 48
    gpt2 = 50257 * d + 1024 * d + L * (12 * d * d + 13 * d) + 2 * d
    assert gpt2 == PUBLISHED["gpt2-xl"][0] and math.isclose(gpt2, 1.558e9, rel_tol=1e-3)
