"""Hooks for tests/; the ``pool`` fixture lives in the root conftest.py (shared with compat/)."""

from __future__ import annotations

import pytest
import torch


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
