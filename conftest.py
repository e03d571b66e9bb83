"""Fixtures and markers shared by ``tests/`` and ``compat/``: one distributed worker pool per
session, and the ``portable`` subset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from oss_plus.testing import WorkerPool

#: The subset run on the oldest and the newest torch of the declared range (``pytest -m
#: portable``, tox -e torch-oldest / torch-newest, CI): the files that exercise what differs
#: between torch versions (the private APIs, torch.optim's classes and keywords, DDP and its
#: comm hooks, GradScaler, foreach kernels, torch.load, the real torch and fairscale classes),
#: each cheap; and one torchrun example. docs/portability.md says why each is in.
PORTABLE = (
    "tests/test_torch_api.py",
    "tests/test_state.py",
    "tests/test_construction.py",
    "tests/test_oss_parity.py",
    "tests/test_oss_api.py",
    "tests/test_sync.py",
    "tests/test_compression.py",
    "tests/test_clip.py",
    "tests/test_amp.py",
    "tests/test_flat.py",
    "tests/test_sdp.py",
    "tests/test_sdp_api.py",
    "tests/test_sdp_zero2.py",
    "tests/test_sdp_flat.py",
    "tests/test_sdp_scaler.py",
    "tests/test_attach.py",
    "tests/test_replan.py",
    "tests/test_overlap.py",
    "tests/test_checkpoint.py",
    "tests/test_checkpoint_fixture.py",
    "tests/test_state_dict_hooks.py",
    "tests/test_step_cost.py",
    "tests/test_trace.py",
    "tests/test_launch.py",
    "tests/test_compat_torch.py",
    "tests/test_gpu.py::test_gpu_tasks_hold_on_cpu",
    "tests/test_examples.py::test_ddp_train_example",
    "compat/test_torch_diff.py",
    "compat/test_fairscale_diff.py",
)
ROOT = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of :data:`PORTABLE` (a file, or a test of a file and its parameters)."""
    for item in items:
        node = Path(item.fspath).relative_to(ROOT).as_posix() + "::" + item.name.split("[")[0]
        if any(node == entry or node.startswith(entry + "::") for entry in PORTABLE):
            item.add_marker(pytest.mark.portable)


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """A pool of 4 gloo workers shared by the whole test session (tests/ and compat/)."""
    workers = WorkerPool(world_size=4)
    yield workers
    workers.close()
