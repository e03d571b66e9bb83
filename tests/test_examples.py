"""Run every example under torchrun on 2 local ranks, and the demo CLI, for a few steps.

The examples and the demo choose their device as users' scripts do
(:func:`oss_plus.choose_device`): a GPU per local rank under NCCL, else gloo on the
CPU. The tests run them on the machine's own GPUs, so the expected fallback line comes from
the device count in use; the choice itself is tested below with simulated device counts.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_python

from oss_plus import DeviceChoice, choose_device
from oss_plus.runtime.launch import visible_gpus

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
#: What the examples and the demo print first when GPUs exist but too few for 2 local ranks.
FALLBACK = "GPU(s) for 2 local ranks: every rank runs on the CPU with gloo"


def run(args: list[str], timeout: float = 180.0, env: dict[str, str] | None = None) -> str:
    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return run_python(args, env=env, timeout=timeout).stdout


def torchrun(script: str, *args: str, nproc: int = 2, env: dict[str, str] | None = None) -> str:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return run([*launch, str(EXAMPLES / script), *args], env=env)


def falls_back(nproc: int = 2) -> bool:
    """Whether this machine's local ranks fall back to the CPU although it has GPUs."""
    return 0 < visible_gpus() < nproc


# ------------------------------------------------------------------ the device choice (pure)
@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("local_ranks", [1, 2, 4])
def test_auto_takes_the_local_ranks_gpu_or_every_rank_falls_back(gpus, local_ranks):
    choices = [choose_device("auto", r, local_ranks, gpus=gpus) for r in range(local_ranks)]
    if gpus >= local_ranks:
        assert choices == [
            DeviceChoice(torch.device("cuda", r), "nccl") for r in range(local_ranks)
        ]
        return
    assert {(c.device, c.backend) for c in choices} == {(torch.device("cpu"), "gloo")}
    notes = {c.note for c in choices}
    assert len(notes) == 1 and "\n" not in notes.pop()  # one line, the same on every rank
    assert all(bool(c.note) == (gpus > 0) for c in choices)  # said only when GPUs were there
    assert all(f"{gpus} GPU(s) for {local_ranks} local ranks" in c.note for c in choices if gpus)


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_device_flag_overrides_the_choice(gpus):
    assert choose_device("cpu", 1, 2, gpus=gpus) == DeviceChoice(torch.device("cpu"), "gloo")
    if gpus >= 2:
        assert choose_device("cuda", 1, 2, gpus=gpus).device == torch.device("cuda", 1)
    else:
        with pytest.raises(
            ValueError, match=f"2 local rank\\(s\\), {gpus} GPU\\(s\\); use --device cpu"
        ):
            choose_device("cuda", 1, 2, gpus=gpus)
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda, got 'tpu'"):
        choose_device("tpu", 0, 1, gpus=gpus)


@pytest.mark.parametrize("available, count", [(False, 0), (True, 1), (True, 2)])
def test_the_choice_reads_the_visible_devices(monkeypatch, available, count):
    """Without ``gpus=``, the count is torch's (0 when CUDA is not available at all)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if available else 5)
    assert visible_gpus() == count
    assert choose_device("auto", 1, 2).backend == ("nccl" if count >= 2 else "gloo")


#: A sitecustomize that makes the device choice of every interpreter torchrun starts see one
#: GPU (torch itself still sees none: its optimizers check CUDA graphs when CUDA is available).
ONE_FAKE_GPU = """\
import oss_plus.runtime.launch

oss_plus.runtime.launch.visible_gpus = lambda: 1
"""


def test_examples_fall_back_to_gloo_on_the_cpu_with_one_gpu_for_two_ranks(tmp_path):
    """The fallback end to end: torchrun's ranks see one GPU for two local ranks (simulated),
    say so on one line from rank 0, and train on the CPU over gloo."""
    (tmp_path / "sitecustomize.py").write_text(ONE_FAKE_GPU)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = run_python([*launch, str(EXAMPLES / "ddp_train.py"), "--steps", "2"], env=env)
    lines = done.stdout.splitlines()
    assert [line for line in lines if "GPU(s)" in line] == [f"1 {FALLBACK} (one GPU per local "
        "rank is needed for NCCL; --device to choose)"]  # fmt: skip
    assert "rank 1: optimizer state for" in done.stdout


def test_examples_import_only_the_public_api():
    """What the examples import from oss_plus is in the public modules (docs/api.rst), and
    no ``_``-prefixed name; every example script is listed in examples/README.md."""
    from test_public_api import PUBLIC_MODULES

    scripts = sorted(EXAMPLES.glob("*.py"))
    found = []
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oss_plus"):
                found += [(script.name, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    (script.name, a.name, "") for a in node.names if a.name.startswith("oss_plus")
                ]
    assert ("_common.py", "oss_plus", "choose_device") in found
    for name, module, imported in found:
        assert module in PUBLIC_MODULES and not imported.startswith("_"), (name, module, imported)
    readme = (EXAMPLES / "README.md").read_text()
    for script in scripts:
        if not script.name.startswith("_"):
            assert f"examples/{script.name}" in readme, script.name


def test_ddp_train_example():
    out = torchrun("ddp_train.py", "--steps", "3")
    assert "step    2" in out
    assert "rank 0: optimizer state for" in out and "rank 1: optimizer state for" in out
    assert (FALLBACK in out) == falls_back()


def test_device_cpu_flag_runs_on_the_cpu_without_a_note():
    out = torchrun("ddp_train.py", "--steps", "1", "--device", "cpu")
    assert "rank 1: optimizer state for" in out and FALLBACK not in out


def test_amp_clip_example():
    out = torchrun("amp_clip.py", "--steps", "3")
    assert "grad norm" in out and "skipped steps (same on every rank)" in out


def test_checkpoint_resume_example_changes_world_size(tmp_path):
    first = torchrun("checkpoint_resume.py", "--steps", "2", "--dir", str(tmp_path))
    assert "saved" in first and "from 2 rank(s)" in first
    second = torchrun(
        "checkpoint_resume.py", "--steps", "2", "--dir", str(tmp_path), "--resume", nproc=1
    )
    assert "resumed at step 2 on 1 rank(s)" in second


def test_checkpoint_resume_example_with_dcp_resumes_exactly(tmp_path):
    """Saved with --dcp, resumed: the last loss is the one of 4 steps without a break
    (other world sizes: tests/test_dcp.py; the example's batches differ by rank)."""
    ckpt = str(tmp_path / "dcp")
    first = torchrun("checkpoint_resume.py", "--steps", "2", "--dir", ckpt, "--dcp")
    assert "saved" in first and "from 2 rank(s) (dcp)" in first
    args = ("checkpoint_resume.py", "--steps", "2", "--dir", ckpt, "--dcp", "--resume")
    second = torchrun(*args)
    assert "resumed at step 2 on 2 rank(s) (dcp)" in second
    whole = torchrun("checkpoint_resume.py", "--steps", "4", "--dir", str(tmp_path / "x"))
    last = [line for line in whole.splitlines() if "step 3  loss" in line]
    assert last and last[0].split("step 3")[1] in second


def test_fairscale_port_example():
    out = torchrun("fairscale_port.py", "--steps", "2")
    assert "OSS is oss_plus.compat.fairscale.OSS" in out
    assert "consolidated state for" in out


def test_demo_cli_reports_identical_losses():
    out = run(["-m", "oss_plus", "demo", "--steps", "4", "--width", "32", "--depth", "2"])
    assert "bit-identical to unsharded Adam on every rank: yes" in out
    # the iteration and the state side by side (their values: tests/test_demo.py)
    (ours, theirs, ratio) = re.findall(
        r"^training iteration +([\d.]+) ms +([\d.]+) ms +([\d.]+)x$", out, re.M
    )[0]
    assert abs(float(ours) / float(theirs) - float(ratio)) < 0.01 + 0.01 * float(ratio)
    states = re.findall(r"^optimizer state, rank (\d) +([\d.]+) KiB +([\d.]+) KiB +([\d.]+)x$",
                        out, re.M)  # fmt: skip
    assert [rank for rank, *_ in states] == ["0", "1"]
    assert abs(sum(float(s[1]) for s in states) - float(states[0][2])) <= 0.02
    assert " ms vs " not in out  # the step alone against Adam's step is no longer printed
    on_gpus = visible_gpus() >= 2
    assert ("on 2 nccl ranks (cuda)" if on_gpus else "on 2 gloo ranks (cpu)") in out
    assert out.startswith(f"{visible_gpus()} {FALLBACK}") == falls_back()


def test_demo_device_flag_and_its_error():
    out = run(["-m", "oss_plus", "demo", "--steps", "2", "--width", "16", "--depth", "1",
               "--device", "cpu", "--amp"])  # fmt: skip
    assert "on 2 gloo ranks" in out and "identical on every rank: yes" in out
    if visible_gpus() < 2:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "oss_plus", "demo", "--device", "cuda"],
                              env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "--device cuda needs one GPU per local rank" in done.stderr


def test_cli_help_lists_every_subcommand():
    out = run(["-m", "oss_plus", "--help"])
    for name in ("demo", "bench", "ckpt"):
        assert name in out


def python_blocks(markdown: Path) -> list[str]:
    """The ```python code blocks of a markdown file, in order."""
    blocks, current = [], None
    for line in markdown.read_text().splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_quickstart_code_runs_under_torchrun(tmp_path):
    train, save = python_blocks(ROOT / "docs" / "quickstart.md")[:2]
    script = tmp_path / "quickstart.py"
    check = "import sys\nn = len(state['state']) if dist.get_rank() == 0 else ''\n"
    # one write per rank: two ranks share the pipe, print() writes its pieces separately
    check += "sys.stdout.write(f'quickstart ok {dist.get_rank()} {n}\\n'); sys.stdout.flush()\n"
    script.write_text(f"{train}\n{save}\n{check}")
    out = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)])
    assert "quickstart ok 0 2" in out and "quickstart ok 1" in out


BLOCK_FAIRSCALE = '''\
"""Test-only: fairscale is not installed (every fairscale import fails before install())."""
import importlib.abc
import sys


class _NoFairscale(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fairscale" or name.startswith("fairscale."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoFairscale())
'''


def test_fairscale_sdp_example_runs_without_fairscale(tmp_path):
    """The fairscale script runs under torchrun where fairscale cannot be imported.

    The venv has fairscale installed, so a ``sitecustomize`` (first on PYTHONPATH, loaded by
    every interpreter torchrun starts) puts a finder first on ``sys.meta_path`` that fails
    every ``fairscale`` import, as an uninstalled fairscale would; ``install()`` then puts
    oss_plus's stand-in before it. The script also reports that what it imported is the
    stand-in.
    """
    (tmp_path / "sitecustomize.py").write_text(BLOCK_FAIRSCALE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    check = subprocess.run(
        [sys.executable, "-c", "import fairscale"], env=env, capture_output=True, text=True
    )
    assert check.returncode != 0 and "No module named 'fairscale'" in check.stderr
    script = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = run_python([*script, str(EXAMPLES / "fairscale_sdp.py"), "--steps", "3"], env=env)
    assert "fairscale served by oss_plus: True" in proc.stdout
    assert "ShardedDataParallel is oss_plus.data_parallel.sharded_ddp" in proc.stdout
    assert "step    2" in proc.stdout
