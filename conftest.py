"""Fixtures shared by ``tests/`` and ``compat/``: one distributed worker pool per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from oss_plus.testing import WorkerPool


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """A pool of 4 gloo workers shared by the whole test session (tests/ and compat/)."""
    workers = WorkerPool(world_size=4)
    yield workers
    workers.close()
