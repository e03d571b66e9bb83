"""Fixtures and markers shared by ``tests/`` and ``compat/``: one distributed worker pool per
test process, the ``portable`` and ``exactness`` subsets, and reproducible BLAS for the suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

#: Reproducible BLAS in every test process (issue 43), set before torch makes its first MKL
#: call (MKL reads it then), inherited by the pool's workers and every subprocess. MKL's
#: matrix-vector product (sgemv: a Linear with one output feature, or a batch of one) sums in
#: an order that depends on the 16-byte alignment of its operands on the code paths MKL picks
#: for AMD CPUs and for Intel CPUs without AVX2 (MKL_ENABLE_INSTRUCTIONS=SSE4_2 shows it on any
#: Intel CPU). The fairscale adapter keeps fairscale's unpadded buckets, so its params sit at
#: other alignments than the unsharded reference's and its bit-identity with that reference
#: holds only where MKL rounds alike whatever the alignment: with MKL_CBWR set (COMPATIBLE:
#: the same results on every x86 CPU). oss_plus's own layouts align every param as torch's
#: allocator does (64 bytes) and need no such setting: OSS_PLUS_NATIVE_BLAS=1 leaves MKL as
#: users run it, skips the tests marked ``reproducible_blas`` and every other one must pass
#: (tox -e blas-paths, .ci/run; docs/portability.md).
NATIVE_BLAS = os.environ.get("OSS_PLUS_NATIVE_BLAS") == "1"
if not NATIVE_BLAS:
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402

from oss_plus.testing import WorkerPool  # noqa: E402

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
#: The bit-identity claims that cross memory layouts (``pytest -m exactness``): what
#: tox -e blas-paths and .ci/run run again under MKL's other code paths (docs/portability.md).
EXACTNESS = (
    "tests/test_blas_paths.py",
    "tests/test_oss_parity.py",
    "tests/test_collective_state_dict.py",
    "tests/test_param_storage.py",
    "tests/test_flat.py",
    "tests/test_sdp_zero2.py",
    "tests/test_sdp_flat.py",
    "tests/test_compression.py",
    "compat/test_fairscale_diff.py",
    "compat/test_torch_diff.py",
    "compat/test_sdp_diff.py",
    "compat/test_overlap_diff.py",
    "compat/test_fairscale_sdp_lightning.py",
)
ROOT = Path(__file__).parent


def _listed(node: str, entries: tuple[str, ...]) -> bool:
    return any(node == entry or node.startswith(entry + "::") for entry in entries)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of :data:`PORTABLE` and :data:`EXACTNESS` (a file, or a test of a file
    and its parameters); under ``OSS_PLUS_NATIVE_BLAS=1`` skips those that need reproducible
    BLAS."""
    native = pytest.mark.skip(reason="needs reproducible BLAS (OSS_PLUS_NATIVE_BLAS=1)")
    for item in items:
        node = Path(item.fspath).relative_to(ROOT).as_posix() + "::" + item.name.split("[")[0]
        if _listed(node, PORTABLE):
            item.add_marker(pytest.mark.portable)
        if _listed(node, EXACTNESS):
            item.add_marker(pytest.mark.exactness)
        if NATIVE_BLAS and item.get_closest_marker("reproducible_blas"):
            item.add_marker(native)


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """A pool of 4 gloo workers shared by every test of this test process (tests/ and compat/;
    under ``-n``, each of pytest-xdist's processes has its own)."""
    workers = WorkerPool(world_size=4)
    yield workers
    workers.close()
