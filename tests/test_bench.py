"""Smoke test of ``python -m oss_plus bench`` in a tiny configuration (no timing asserts)."""

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oss_plus.bench import (
    async_ckpt,
    checkpoint_bench,
    cli,
    ddp_bench,
    impls,
    report,
    step_bench,
    zero2,
)
from oss_plus.bench.impls import IMPLS, Impl
from oss_plus.bench.step_bench import BenchResult, run
from oss_plus.bench.step_config import ALL_IMPLS, FULL_SWEEP_SIZES, MAIN_IMPLS, BenchConfig
from oss_plus.bench.summary import WIDTH, summary_table
from oss_plus.cli import build_parser, main
from oss_plus.runtime.launch import visible_gpus

TINY = [
    "bench",
    "--size",
    "0.05",
    "--width",
    "64",
    "--world-size",
    "2",
    "--rounds",
    "1",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--sweep-sizes",
    "",
]
ROWS = "oss_plus,oss_plus_bf16,oss_plus_sync,torch_zero_bv,unsharded,floor"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny bench through the real command line (spawns its own gloo ranks)."""
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([*TINY, "--impls", ROWS, "--memory-impls", "oss_plus,floor", "--out", str(out)])
    return code, json.loads((out / "bench.json").read_text()), out, printed.getvalue()


def test_bench_writes_every_row_with_consistent_bytes(tiny_run):
    code, data, _, _ = tiny_run
    assert code == 0
    rows = data["rows"]
    assert list(rows) == ROWS.split(",")
    for key, row in rows.items():
        assert row["step_s"] > 0 and len(row["times_s"]) == 2, key
        assert len(row["state_bytes"]) == 2
        assert ("rss" in row) == (key in ("oss_plus", "floor"))
        for rank in row.get("rss", []):
            assert rank["peak"] >= rank["steady"] > rank["base"] > 0
    # the shards add up to the unsharded state, the bf16 wire is half the fp32 one
    assert sum(rows["oss_plus"]["state_bytes"]) == rows["unsharded"]["state_bytes"][0]
    assert rows["oss_plus"]["state_bytes"] == rows["floor"]["state_bytes"]
    assert rows["oss_plus_bf16"]["wire_bytes"] * 2 == rows["oss_plus"]["wire_bytes"] > 0
    assert rows["floor"]["wire_bytes"] == rows["unsharded"]["wire_bytes"] == 0
    # the main copies: 4 bytes per element a rank sends compressed, none without the wire
    mains, numels = rows["oss_plus_bf16"]["main_bytes"], rows["oss_plus_bf16"]["compressed_numel"]
    assert all(m == 4 * n > 0 for m, n in zip(mains, numels))
    assert sum(mains) >= 4 * 12 * (64 * 64 + 64)  # every param once: 12 x Linear(64, 64)
    assert rows["oss_plus"]["main_bytes"] == [0, 0]
    assert data["ratios"]["floor"]["vs_floor"] == 1.0
    # CPU per step is counted on every row; the sync-only row moves oss_plus's bytes, no state
    for key, row in rows.items():
        assert row["cpu_s"] > 0 and 0 < row["busy_cores"] <= 2 * data["machine"]["cores"], key
    assert rows["oss_plus_sync"]["wire_bytes"] == rows["oss_plus"]["wire_bytes"]
    assert rows["oss_plus_sync"]["state_bytes"] == [0, 0]
    assert data["machine"]["threads_per_rank"] >= 1


def result_of(data: dict) -> BenchResult:
    """The BenchResult a bench.json was written from."""
    return BenchResult(**{k: v for k, v in data.items() if k != "ratios"})


def test_bench_prints_the_json_path_first_then_a_summary_within_100_columns(tiny_run):
    _, data, out, text = tiny_run
    lines = text.splitlines()
    assert lines[0].startswith(f"oss-plus bench: results go to {out / 'bench.json'}")
    table = lines[lines.index("") + 1 :]  # the summary (the path lines may be long)
    summary = summary_table(result_of(data))
    assert "\n".join(table).startswith(summary) and summary.count("\n") > len(ROWS.split(","))
    assert max(len(line) for line in summary.splitlines()) <= WIDTH
    assert "CPU ms" not in text  # the wide table: --details
    # every ratio is the row's figure over oss_plus's, in the time and the state columns
    rows = data["rows"]
    for key, row in rows.items():
        (line,) = [x for x in summary.splitlines() if x.startswith(IMPLS[key].label + "  ")]
        cells = line[len(IMPLS[key].label) :].split()
        ratio_time = row["step_s"] / rows["oss_plus"]["step_s"]
        ratio_state = max(row["state_bytes"]) / max(rows["oss_plus"]["state_bytes"])
        assert float(cells[1]) == pytest.approx(ratio_time, abs=0.006), key
        assert float(cells[3]) == pytest.approx(ratio_state, abs=0.006), key
        assert (cells[4] == "-") == ("rss" not in row), key  # peak RSS: measured rows only
    assert float(cells[3]) == 1.0 and "x oss_plus: the row's figure over" in summary


def test_details_keep_every_column(tiny_run):
    _, data, out, _ = tiny_run
    result = result_of(data)
    details = report.table(result) + "\n".join(report.summary_lines(result))
    assert "CPU ms" in details and "oss_plus sync only" in details
    assert "no schedule finishes it in under" in details
    assert "bytes per element it sends compressed" in details


def test_bench_draws_a_plot_or_says_how_to_get_one(tiny_run, monkeypatch):
    _, data, out, text = tiny_run
    assert "pip install oss_plus" not in text and "oss_plus[docs]" not in text
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert report.plot(result_of(data), out / "none.png") == report.NO_PLOT
    assert 'pip install -e ".[docs]"' in report.NO_PLOT and not (out / "none.png").exists()
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").stat().st_size > 0
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_peers_are_skipped_with_a_note(monkeypatch, capfd):
    ghost = Impl(
        "fairscale", "fairscale OSS", IMPLS["fairscale"].build, needs="not_a_real_package_x"
    )
    monkeypatch.setitem(impls.IMPLS, "fairscale", ghost)
    cfg = BenchConfig(
        size=0.02,
        width=32,
        rounds=1,
        steps=1,
        warmup=0,
        memory=False,
        impls=("fairscale", "floor"),
        sweep_sizes=(),
    )
    lines = []
    result = run(cfg, log=lines.append)
    assert list(result.rows) == ["floor"]
    assert "not_a_real_package_x is not installed" in result.skipped["fairscale"]
    assert any("skipping ['fairscale']" in line for line in lines)
    text = report.table(result)
    assert "skipped fairscale OSS: not_a_real_package_x is not installed" in text
    assert "skipped fairscale OSS: not_a_real_package_x" in summary_table(result)
    # rank 0 said on stderr how far the timing was (the parent's fd 2, inherited)
    err = capfd.readouterr().err
    assert "[bench] timing 1/1: 0.02M params, round 1 of 1 (1 rows x 1 steps" in err
    assert "done in" in err


def test_progress_lines_extrapolate_what_is_left():
    from oss_plus.bench.progress import Progress

    line = Progress("memory", 4, then="size sweep").line(1, "RSS of floor", 30.0)
    assert (
        line
        == "[bench] memory 1/4: RSS of floor; 30 s so far, about 1 min 30 s left, then size sweep"
    )
    assert Progress("memory", 4).line(4, "x", 61).endswith("; done in 1 min 1 s")
    cfg = BenchConfig(sweep_sizes=(5.0, 20.0), sweep_worlds=(1,))
    ahead = step_bench.phases_ahead(cfg, list(MAIN_IMPLS))
    assert list(ahead) == ["timing", "memory", "size sweep", "world sweep"]
    assert ahead["size sweep"] == "size sweep (5M params)"  # 20M: the main run's point
    assert step_bench._then(ahead, "timing") == "memory (7 rows, fresh ranks each) and 2 more"
    assert step_bench._then(ahead, "world sweep") == ""


def test_quick_and_flags_build_the_config():
    args = build_parser().parse_args(["bench", "--quick", "--size", "3", "--sweep-worlds", "1,4"])
    cfg = cli.config_from_args(args)
    assert (cfg.rounds, cfg.steps, cfg.size, cfg.sweep_sizes, cfg.sweep_worlds) == (
        1,
        4,
        3.0,
        (),
        (1, 4),
    )
    assert cfg.impls == cli.QUICK_IMPLS
    default = cli.config_from_args(build_parser().parse_args(["bench"]))
    assert default == BenchConfig() and default.layers() == 19  # 20M params of Linear(1024, 1024)
    # the default is short: the main rows, their RSS, no sweep; --full adds the rest
    assert (default.impls, default.sweep_sizes, default.memory) == (MAIN_IMPLS, (), True)
    full = cli.config_from_args(build_parser().parse_args(["bench", "--full", "--rounds", "2"]))
    assert (full.impls, full.sweep_sizes, full.rounds) == (ALL_IMPLS, FULL_SWEEP_SIZES, 2)
    assert full.memory_impls == step_bench.MEMORY_IMPLS and "fairscale_fp16" in ALL_IMPLS
    with pytest.raises(ValueError, match="--quick and --full are different runs: pick one"):
        cli.config_from_args(build_parser().parse_args(["bench", "--quick", "--full"]))


def test_many_tensors_noop_run_measures_the_wrappers_alone(tmp_path):
    """--tensors splits the same size into equal tensors; --optimizer noop leaves only the
    wrappers' own work: host time, and host reads per step (none for oss_plus at any world
    size since issue 27, none for fairscale), measured in the run itself.

    The device is the bench's default (auto): a GPU per rank under NCCL where the machine has
    enough, else the CPU. On CUDA the bench measures the device memory a step peaks at (the
    column is None on the CPU, where the RSS columns stand in) and counts device-to-host
    syncs."""
    rows = "oss_plus,fairscale,torch_zero_bv,floor"
    argv = ["bench", "--size", "0.004", "--tensors", "40", "--optimizer", "noop", "--rounds", "1"]
    argv += ["--steps", "3", "--warmup", "1", "--sweep-sizes", "", "--no-memory", "--no-plot"]
    for world in (1, 2):
        out = tmp_path / str(world)
        with contextlib.redirect_stdout(io.StringIO()):
            code = main([*argv, "--world-size", str(world), "--impls", rows, "--out", str(out)])
        assert code == 0
        data = json.loads((out / "bench.json").read_text())
        assert data["config"]["tensors"] == 40 and data["config"]["device"] == "auto"
        on_cuda = data["machine"]["backend"] == "nccl"  # auto: the GPU under NCCL, else the CPU
        assert on_cuda == (visible_gpus() >= world)
        for key, row in data["rows"].items():
            assert row["host_s"] > 0, key
            peak = row["peak_over_steady"]
            assert peak >= 0 if on_cuda else peak is None, (key, peak)
            assert row["state_bytes"] == [0] * world, key  # the inner step keeps no state
        syncs = {k: r["syncs"] for k, r in data["rows"].items()}
        assert syncs == {"oss_plus": 0, "fairscale": 0, "torch_zero_bv": 0, "floor": 0}
        assert (data["rows"]["oss_plus"]["wire_bytes"] > 0) == (world > 1)  # nothing alone


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--optimizer", "lamb"], "--optimizer must be one of"),
        (["--impls", "oss_plus,deepspeed"], "unknown implementation(s) ['deepspeed']"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--backend", "mpi"], "--backend must be auto, gloo or nccl"),
        (["--tensors", "-1"], "--tensors must be >= 0"),
        (["--device", "tpu"], "--device must be auto, cpu or cuda"),
        (["--ddp", "--checkpoint"], "--ddp and --checkpoint are different benchmarks: pick one"),
        (
            ["--checkpoint", "--async-checkpoint"],
            "--checkpoint and --async-checkpoint are different benchmarks: pick one",
        ),
        (["--checkpoint", "--impls", "orbax"], "unknown --impls ['orbax'] for --checkpoint"),
        (["--ddp", "--impls", "deepspeed"], "unknown --impls ['deepspeed']: choose from"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oss-plus bench: error:") and message in err and "\n" not in err


def test_async_checkpoint_bench_measures_against_dcp():
    """The async rows run from the CLI and every figure is a real, positive measurement.

    Run as a subprocess, as a user would. (It once hung one run in two: each rank stopped
    stepping when its own save was done, so the ranks' collectives no longer matched; the
    ranks now agree before every step.)
    """
    argv = ["bench", "--async-checkpoint", "--size", "0.2", "--world-size", "2", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "oss_plus", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for row in ("blocking save", "stall of an async save", "load on 1 rank"):
        line = next(x for x in out.splitlines() if x.startswith(f"| {row}"))
        ours, dcp = (float(cell.strip().rstrip(" s")) for cell in line.split("|")[2:4])
        assert ours > 0 and dcp > 0
    assert "step while a save is in flight" in out


def test_zero2_bench_shows_the_gradient_memory_zero2_saves(capsys):
    """``bench --zero2``: ShardedDataParallel's ranks hold fewer gradient bytes than DDP's."""
    argv = ["bench", "--zero2", "--width", "512", "--steps", "2", "--rounds", "2"]
    configs = ("oss_plus_sdp", "ddp_oss", "ddp_adam")
    assert main([*argv, "--impls", ",".join(configs)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    grads = {(r[0], r[1]): float(r[3]) for r in rows if r and r[0] in configs}
    assert len(grads) == 6
    for rank in ("0", "1"):
        assert 0 < grads[("oss_plus_sdp", rank)] < grads[("ddp_oss", rank)]
        assert grads[("ddp_adam", rank)] == grads[("ddp_oss", rank)]  # DDP keeps every grad
    # the many-small-layers row: every config on both ranks, DDP + OSS the 1.00x anchor of
    # the "vs DDP" column, DDP + the plain Adam that of the last column
    small = {(r[1], r[2]): r for r in rows if r and r[0] == "small-layers" and r[2] in "01"}
    assert sorted(small) == [(c, k) for c in sorted(configs) for k in "01"]
    for k in "01":
        assert small[("ddp_oss", k)][4] == "1.00x" and small[("ddp_adam", k)][6] == "1.00x"
        assert float(small[("oss_plus_sdp", k)][3]) > 0


# ------------------------------------------------------------------ docs/benchmarks.md "GPU"
class _Spawned(Exception):
    """Raised by the stand-in of run_local: the command got as far as starting its ranks."""


def gpu_section_commands() -> list[list[str]]:
    """The ``python -m oss_plus bench`` lines of the GPU section, continuation lines joined."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    section = text[text.index("\n## GPU\n") :]
    section = section[: section.index("\n## ", 1)].replace("\\\n", " ")
    lines = [line.split("#")[0] for line in section.splitlines()]
    return [shlex.split(line)[3:] for line in lines if line.startswith("python -m oss_plus bench")]


def test_gpu_section_commands_start_their_ranks_with_one_gpu(monkeypatch):
    """Each bench line of the GPU section, through the real CLI with one (simulated) GPU,
    reaches the spawn of its ranks with a backend that has a GPU per rank; the same line with
    one rank more than GPUs under NCCL stops with the one-line error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spawned = []

    def spawn(fn, world_size, *args, backend="gloo", threads=0):
        spawned.append((world_size, backend))
        raise _Spawned

    for module in (step_bench, zero2, async_ckpt, ddp_bench, checkpoint_bench):
        monkeypatch.setattr(module, "run_local", spawn)
    commands = gpu_section_commands()
    assert len(commands) >= 5 and any("nccl" in c for c in commands)
    for argv in commands:
        spawned.clear()
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(_Spawned):
            main(argv)
        (world, backend), nccl = spawned[0], "nccl" in argv
        assert backend == ("nccl" if nccl else "gloo") and (world == 1 or not nccl), argv


@pytest.mark.parametrize("extra", [[], ["--zero2"]], ids=["step", "zero2"])
def test_nccl_with_fewer_gpus_than_ranks_is_a_one_line_error(monkeypatch, capsys, extra):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", *extra, "--backend", "nccl", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "oss-plus bench: error: --backend nccl needs one GPU per rank: 2 ranks, 1 GPU(s); "
        "use --backend gloo"
    )


def test_zero2_rejects_an_unknown_config_instead_of_running_fairscale():
    for name in ("ddp", "fairscale", "ddp_again", "oss_plus_sdp_typo"):
        with pytest.raises(ValueError, match=f"unknown config '{name.removesuffix('_again')}'"):
            zero2._wrap(name, torch.nn.Linear(2, 2), 0)
    for name in (*zero2.CONFIGS, *zero2.EXTRA_CONFIGS, "fairscale_sdp_again"):
        zero2.check_config(name)  # every config the bench documents is accepted


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "1"], "--steps must be at least 2"),
        (["--deep-rounds", "0"], "--deep-rounds must be at least 1"),
        (["--configs", "ddp_oss,ddp"], "unknown config 'ddp'"),
    ],
)
def test_zero2_rejects_bad_arguments_before_starting_ranks(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        zero2.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
