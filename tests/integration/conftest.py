"""Framework recipes: each runs under ``torchrun --nproc_per_node 2`` in subprocesses."""

from __future__ import annotations

import os
import re
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


class RecipeFailed(Exception):
    """A torchrun launch of a recipe exited non-zero."""

    def __init__(self, recipe: str, phase: str, done: subprocess.CompletedProcess[str]) -> None:
        self.phase, self.error = phase, last_error(done.stderr)
        super().__init__(
            f"{recipe} {phase} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        )


def last_error(stderr: str) -> str:
    """The last ``SomeError: message`` line a rank printed (the framework's own words), not
    torchrun's report that a child failed."""
    lines = (RANK_PREFIX.sub("", line).strip() for line in stderr.splitlines())
    errors = [line for line in lines if ERROR_LINE.match(line) and TORCHRUN not in line]
    return errors[-1] if errors else stderr.strip()[-300:]


#: A traceback's final line: an exception class name, a colon, the message.
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")
#: What torchrun puts before each line of a rank's output.
RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
#: torchrun's own exception when a rank failed.
TORCHRUN = "ChildFailedError"


def launch(
    recipe: str, phase: str, out: Path, python: str = sys.executable, extra_env: dict | None = None
) -> None:
    """Run ``recipes/<recipe>.py phase out`` on 2 gloo ranks with torchrun.

    Raises:
        RecipeFailed: the launch exited non-zero.
    """
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "TOKENIZERS_PARALLELISM": "false",
        **(extra_env or {}),
    }
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(RECIPES / f"{recipe}.py"), phase, str(out)]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise RecipeFailed(recipe, phase, done)


def assert_resumed_equals_reference(out: Path) -> None:
    """The resumed sharded run equals the unsharded reference: params and optimizer state."""
    reference = load_file(out / "reference.safetensors")
    resumed = load_file(out / "resumed.safetensors")
    assert sorted(resumed) == sorted(reference)
    assert any(k.startswith("optim.") for k in reference)
    different = [k for k in reference if not torch.equal(resumed[k], reference[k])]
    assert not different, different


def train_and_resume(recipe: str, out: Path, python: str, extra_env: dict | None = None) -> None:
    """Train + save, resume in fresh processes, compare with the reference."""
    out.mkdir(parents=True, exist_ok=True)
    launch(recipe, "train", out, python, extra_env)
    launch(recipe, "resume", out, python, extra_env)
    assert_resumed_equals_reference(out)


@pytest.fixture
def run_recipe(tmp_path: Path):
    """Train + save, resume in fresh processes, compare with the reference.

    With ``control`` (environment variables that make the recipe run the same flow with the
    plain torch optimizer, no oss_plus), a failed launch is run again that way: if the
    control fails in the same phase with the same error, the framework is what fails in this
    environment, and the test is skipped with the framework's own error; otherwise the
    original failure stands.
    """

    def run(recipe: str, python: str = sys.executable, control: dict | None = None) -> Path:
        try:
            train_and_resume(recipe, tmp_path / "sharded", python)
        except RecipeFailed as failure:
            if control is None:
                pytest.fail(str(failure))
            try:
                train_and_resume(recipe, tmp_path / "control", python, control)
            except RecipeFailed as same:
                if (same.phase, same.error) == (failure.phase, failure.error):
                    pytest.skip(
                        f"{recipe} fails at {failure.phase} without oss_plus too (plain "
                        f"optimizer, same flow): {failure.error}"
                    )
            pytest.fail(f"{failure}\n(the plain-optimizer control run did not fail this way)")
        return tmp_path / "sharded"

    return run


@pytest.fixture
def run_recipe_once(tmp_path: Path):
    """Run a recipe's ``train`` phase alone (it trains both runs), then compare its
    ``resumed`` file with its ``reference`` file."""

    def run(recipe: str, python: str = sys.executable) -> None:
        launch(recipe, "train", tmp_path, python)
        assert_resumed_equals_reference(tmp_path)

    return run


@pytest.fixture
def launch_recipe():
    """:func:`launch` (one phase of a recipe; the test compares what it wrote)."""
    return launch
