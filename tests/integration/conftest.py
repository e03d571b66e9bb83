"""Framework recipes: each runs under ``torchrun --nproc_per_node 2`` in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

RECIPES = Path(__file__).parent / "recipes"
#: Seconds one torchrun launch may take (two processes importing a framework, a few steps).
LAUNCH_TIMEOUT = 300


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this directory carries the ``integration`` marker."""
    for item in items:
        if str(item.fspath).startswith(str(Path(__file__).parent)):
            item.add_marker(pytest.mark.integration)


def launch(recipe: str, phase: str, out: Path, python: str = sys.executable) -> None:
    """Run ``recipes/<recipe>.py phase out`` on 2 gloo ranks with torchrun; fail on error."""
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(RECIPES / f"{recipe}.py"), phase, str(out)]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"{recipe} {phase} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def assert_resumed_equals_reference(out: Path) -> None:
    """The resumed sharded run equals the unsharded reference: params and optimizer state."""
    reference = load_file(out / "reference.safetensors")
    resumed = load_file(out / "resumed.safetensors")
    assert sorted(resumed) == sorted(reference)
    assert any(k.startswith("optim.") for k in reference)
    different = [k for k in reference if not torch.equal(resumed[k], reference[k])]
    assert not different, different


@pytest.fixture
def run_recipe(tmp_path: Path):
    """Train + save, resume in fresh processes, compare with the reference."""

    def run(recipe: str, python: str = sys.executable) -> Path:
        launch(recipe, "train", tmp_path, python)
        launch(recipe, "resume", tmp_path, python)
        assert_resumed_equals_reference(tmp_path)
        return tmp_path

    return run
