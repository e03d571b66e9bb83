"""Run every example under torchrun on 2 gloo ranks, and the demo CLI, for a few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(args: list[str], timeout: float = 180.0) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return run_python(args, env=env, timeout=timeout).stdout


def torchrun(script: str, *args: str, nproc: int = 2) -> str:
    return run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(EXAMPLES / script),
            *args,
        ]
    )


def test_ddp_train_example():
    out = torchrun("ddp_train.py", "--steps", "3")
    assert "step    2" in out
    assert "rank 0: optimizer state for" in out and "rank 1: optimizer state for" in out


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


def test_fairscale_port_example():
    out = torchrun("fairscale_port.py", "--steps", "2")
    assert "OSS is oss_plus.compat.fairscale.OSS" in out
    assert "consolidated state for" in out


def test_demo_cli_reports_identical_losses():
    out = run(["-m", "oss_plus", "demo", "--steps", "4", "--width", "32", "--depth", "2"])
    assert "bit-identical to unsharded Adam on every rank: yes" in out
    assert "rank 1: optimizer state" in out


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
