"""``python -m oss_plus ckpt inspect|convert`` and the migration of fairscale / torch ZeRO
``.pt`` checkpoints into oss_plus checkpoints loaded at another world size."""

from __future__ import annotations

import copy
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_model, params_equal, train
from test_checkpoint import build, diff, save_task

from oss_plus import OSS, load_checkpoint
from oss_plus.checkpoint import read_state_dict
from oss_plus.checkpoint.cli import ProgressBar
from oss_plus.cli import main


def run(capsys, *argv):
    code = main(["ckpt", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ inspect
def test_inspect_prints_params_state_dtypes_sizes_groups_and_world_size(pool, tmp_path, capsys):
    pool.run(save_task, str(tmp_path / "c"), world_size=2)
    code, out, _ = run(capsys, "inspect", tmp_path / "c")
    assert code == 0
    assert "sharded layout" in out and "torch.optim.adam.Adam" in out
    assert "saved on:   2 ranks, partition rule fairscale" in out
    assert "files:      2," in out and out.count("shard-0000") == 2
    assert re.search(r"group 0: 8 params; lr=0\.01, amsgrad=True, betas=\(0\.9, 0\.999\)", out)
    header = next(line for line in out.splitlines() if line.startswith("index"))
    assert header.split() == [
        "index",
        "group",
        "rank",
        "shape",
        "dtype",
        "trainable",
        "bytes",
        "state",
    ]
    row = next(line for line in out.splitlines() if line.startswith("2 "))
    assert row.split()[:7] == ["2", "0", "1", "10x8", "F32", "yes", "964"]
    assert "exp_avg:F32[10x8]" in row and "step:F32[scalar]" in row and "max_exp_avg_sq" in row
    assert "verified" not in out
    assert re.search(r"checksum:   index.json crc32 [0-9a-f]{8} \(matches\)", out)


def test_inspect_refuses_an_edited_index_and_says_an_old_one_carries_no_checksum(
    pool, tmp_path, capsys
):
    pool.run(save_task, str(tmp_path / "c"), world_size=2)
    index = tmp_path / "c" / "index.json"
    index.write_text(index.read_text().replace('"lr": {"float": 0.01}', '"lr": {"float": 0.02}'))
    for args in (["inspect"], ["inspect", "--verify"]):
        code, out, err = run(capsys, *args, tmp_path / "c")
        assert code == 2 and out == "" and str(index) in err and "checksum is" in err
    old = Path(__file__).parent / "fixtures" / "checkpoint_v1" / "sharded"
    code, out, _ = run(capsys, "inspect", "--verify", old)
    assert code == 0 and "format v1" in out and "verified:" in out
    assert "checksum:   no index checksum (format v1 predates it" in out


def test_inspect_verify_reads_every_tensor_and_reports_corruption(pool, tmp_path, capsys):
    pool.run(save_task, str(tmp_path / "c"), world_size=2)
    code, out, _ = run(capsys, "inspect", "--verify", tmp_path / "c")
    assert code == 0 and "verified:   32 tensors match their checksums" in out
    shard = sorted((tmp_path / "c").glob("shard-00001*"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x10
    shard.write_bytes(raw)
    assert run(capsys, "inspect", tmp_path / "c")[0] == 0  # the index alone looks fine
    code, _, err = run(capsys, "inspect", "--verify", tmp_path / "c")
    assert code == 2 and shard.name in err and "checksum" in err


def test_inspect_of_a_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    code, out, err = run(capsys, "inspect", tmp_path / "nope")
    assert code == 2 and out == "" and err.count("\n") == 1 and "does not exist" in err


# ------------------------------------------------------------------ convert
class Opaque:
    """Not loadable with weights_only=True."""


def plain_adam_file(tmp_path, wrap=None):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    train(model, opt, 2)
    sd = opt.state_dict()
    torch.save(sd if wrap is None else {wrap: sd, "epoch": 3}, tmp_path / "in.pt")
    return copy.deepcopy(sd)


def test_convert_writes_a_checkpoint_equal_to_the_state_dict(tmp_path, capsys):
    sd = plain_adam_file(tmp_path)
    code, out, err = run(capsys, "convert", tmp_path / "in.pt", tmp_path / "out")
    assert code == 0 and "wrote" in out and "8 params, 24 tensors" in out
    assert diff(read_state_dict(tmp_path / "out"), sd) is None
    assert "100%" in err and "[" + "#" * 30 + "]" in err  # the progress bar, on stderr


def test_convert_finds_a_nested_state_dict_or_takes_key(tmp_path, capsys):
    sd = plain_adam_file(tmp_path, wrap="optimizer")
    code, _, err = run(capsys, "convert", tmp_path / "in.pt", tmp_path / "a")
    assert code == 0 and "under 'optimizer'" in err
    assert run(capsys, "convert", "--key", "optimizer", tmp_path / "in.pt", tmp_path / "b")[0] == 0
    for out in ("a", "b"):
        assert diff(read_state_dict(tmp_path / out), sd) is None


@pytest.mark.parametrize(
    ("content", "argv", "words"),
    [
        ({"epoch": 3, "model": {}}, [], "top-level keys are ['epoch', 'model']: pass --key"),
        ({"epoch": 3}, ["--key", "epoch"], "under 'epoch'"),
        ({"x": Opaque()}, [], "weights_only=True"),
        (None, [], "does not exist"),
    ],
    ids=["no state dict", "wrong key", "unsafe pickle", "missing file"],
)
def test_convert_errors_say_what_to_do(tmp_path, capsys, content, argv, words):
    if content is not None:
        torch.save(content, tmp_path / "in.pt")
    code, _, err = run(capsys, "convert", *argv, tmp_path / "in.pt", tmp_path / "out")
    assert code == 2 and words in err and not (tmp_path / "out").exists()


def test_progress_bar_draws_on_percent_changes_and_ends_the_line():
    stream = io.StringIO()
    bar = ProgressBar("x", stream=stream, width=10)
    for done in range(0, 1001):
        bar(done, 1000)
    text = stream.getvalue()
    assert text.count("\r") == 101 and text.endswith("\n") and "[##########] 100%" in text


def test_python_dash_m_oss_plus_ckpt_runs(tmp_path):
    plain_adam_file(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oss_plus",
            "ckpt",
            "convert",
            str(tmp_path / "in.pt"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "100%" in done.stderr, done.stderr


# ------------------------------------------------------------------ migration from the peers
def peers_task(ctx, root, kind):
    model = make_model()
    if kind == "fairscale":
        from fairscale.optim import OSS as FairscaleOSS

        opt = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.Adam,
            process_group=ctx.group,
            lr=0.01,
        )
    train(model, opt, 2)
    opt.consolidate_state_dict(0)
    if ctx.rank == 0:
        params = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save({"optimizer": opt.state_dict(), "model": params}, f"{root}/{kind}.pt")


def migrated_task(ctx, root, kind):
    saved = torch.load(f"{root}/{kind}.pt", weights_only=True)
    model = build("plain")
    model.load_state_dict(saved["model"])
    ref_model = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=5.0)
    load_checkpoint(opt, f"{root}/{kind}")
    ref = torch.optim.Adam(ref_model.parameters(), lr=5.0)
    ref.load_state_dict(saved["optimizer"])
    train(model, opt, 2, start=2)
    train(ref_model, ref, 2, start=2)
    return params_equal(model, ref_model)


@pytest.mark.parametrize("kind", ["fairscale", "zero"])
def test_fairscale_and_torch_zero_checkpoints_convert_and_load_at_another_world_size(
    pool, tmp_path, capsys, kind
):
    if kind == "fairscale":
        pytest.importorskip("fairscale", reason="converts a checkpoint of fairscale's own OSS")
    pool.run(peers_task, str(tmp_path), kind, world_size=2)
    code, _, err = run(capsys, "convert", tmp_path / f"{kind}.pt", tmp_path / kind)
    assert code == 0, err
    original = torch.load(tmp_path / f"{kind}.pt", weights_only=True)["optimizer"]
    assert diff(read_state_dict(tmp_path / kind)["state"], original["state"]) is None
    assert pool.run(migrated_task, str(tmp_path), kind, world_size=3) == [True] * 3
