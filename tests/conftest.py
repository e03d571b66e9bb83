"""Shared pytest fixtures: one persistent distributed worker pool per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from oss_plus.testing import WorkerPool


def pytest_configure(config: pytest.Config) -> None:
    """Registers the custom markers."""
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is available")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the tests marked ``gpu`` when CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """A pool of 4 gloo workers shared by the whole test session."""
    workers = WorkerPool(world_size=4)
    yield workers
    workers.close()
