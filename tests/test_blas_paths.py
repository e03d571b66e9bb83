"""Bit-identity on any x86 CPU, whatever code path MKL picks there (issue 43).

On the code paths MKL takes on AMD CPUs and on Intel CPUs without AVX2 (shown here on any
Intel CPU with ``MKL_ENABLE_INSTRUCTIONS=SSE4_2``), its matrix-vector product (``sgemv``: a
``Linear`` with one output feature, or a batch of one) sums in an order that depends on the
16-byte alignment of its operands, unless ``MKL_CBWR`` is set. Full matrix products, the
backward's products and the optimizers' kernels do not (measured: ``docs/portability.md``).

* The suite runs with ``MKL_CBWR=COMPATIBLE`` (``conftest.py``): the first test checks that it
  reaches the pool's workers.
* oss_plus's own layouts align every param as torch's allocator does (64 bytes), so ``OSS`` is
  bit-identical to the unsharded optimizer without that setting too; the fairscale adapter
  keeps fairscale's unpadded buckets, so it is bit-identical to the real fairscale ``OSS``
  there, not to the unsharded optimizer. The second test runs both on MKL's
  alignment-dependent path, in fresh processes without ``MKL_CBWR``.
"""

from __future__ import annotations

import copy
import os
import platform

import pytest
import torch
import torch.distributed as dist
from helpers import batch, make_diff_model

from oss_plus import OSS
from oss_plus.compat import fairscale as compat_fairscale
from oss_plus.runtime.launch import run_local

pytestmark = pytest.mark.exactness

NATIVE_BLAS = os.environ.get("OSS_PLUS_NATIVE_BLAS") == "1"
STEPS = 4


def matvec_depends_on_alignment() -> bool:
    """Whether this process's ``Linear(10, 1)`` forward changes when its weight or its input
    starts at another 4-byte offset from a 64-byte boundary (MKL's ``sgemv``)."""
    gen = torch.Generator().manual_seed(0)
    weight, x, bias = (torch.randn(*s, generator=gen) for s in ((1, 10), (6, 10), (1,)))
    want = torch.addmm(bias, x, weight.t())

    def moved(t: torch.Tensor, offset: int) -> torch.Tensor:
        view = torch.empty(t.numel() + 16)[offset : offset + t.numel()].view_as(t)
        return view.copy_(t)

    return any(
        not torch.equal(torch.addmm(bias, moved(x, o), moved(weight, (o * 3) % 16).t()), want)
        for o in range(16)
    )


def probe_task(ctx):
    return matvec_depends_on_alignment()


@pytest.mark.skipif(NATIVE_BLAS, reason="OSS_PLUS_NATIVE_BLAS=1 leaves MKL as users run it")
def test_the_suite_runs_with_reproducible_blas(pool):
    """conftest.py's ``MKL_CBWR`` reaches this process and every worker of the pool."""
    assert os.environ.get("MKL_CBWR")
    assert not matvec_depends_on_alignment()
    assert pool.run(probe_task, world_size=4) == [False] * 4


def _train(model, opt, rank):
    for step in range(STEPS):
        opt.zero_grad()
        model(batch(step, width=8, n=6, rank=rank)).pow(2).mean().backward()
        for p in model.parameters():  # the data-parallel average, as DDP takes it
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _unsharded(world):
    """The plain Adam on the same data: each rank's batch, averaged as DDP does."""
    model = make_diff_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        grads = []
        for rank in range(world):
            model.zero_grad()
            model(batch(step, width=8, n=6, rank=rank)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total += g[i]
            p.grad = total.div_(world)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def native_task(rank, world):
    """On MKL's code path without ``MKL_CBWR``: OSS, the fairscale adapter and (if installed)
    the real fairscale OSS against the unsharded Adam."""
    out = {"depends": matvec_depends_on_alignment(), "cbwr": os.environ.get("MKL_CBWR")}
    base = make_diff_model()
    model = copy.deepcopy(base)
    out["oss"] = _train(model, OSS(model.parameters(), torch.optim.Adam, lr=0.01), rank)
    model = copy.deepcopy(base)
    adapter = compat_fairscale.OSS(model.parameters(), torch.optim.Adam, lr=0.01)
    out["adapter"] = _train(model, adapter, rank)
    try:
        from fairscale.optim import OSS as FairscaleOSS
    except ImportError:
        out["fairscale"] = None
    else:
        model = copy.deepcopy(base)
        real = FairscaleOSS(model.parameters(), torch.optim.Adam, lr=0.01)
        out["fairscale"] = _train(model, real, rank)
    out["unsharded"] = _unsharded(world)
    return out  # lists of floats: a tensor would outlive its rank in the queue


@pytest.mark.skipif(
    "mkl" not in torch.__config__.show().lower() or platform.machine() not in ("x86_64", "AMD64"),
    reason="MKL's code paths are an x86 matter",
)
def test_oss_is_bit_identical_on_mkls_alignment_dependent_path(monkeypatch):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")  # the path AMD CPUs get
    results = run_local(native_task, 2)
    for r in results:
        assert r["cbwr"] is None
        if not r["depends"]:
            pytest.skip("MKL's SSE4.2 path does not depend on alignment on this machine")
        # oss_plus's own layout: aligned as standalone tensors, so exact anyway
        assert r["oss"] == r["unsharded"]
        # fairscale's unpadded layout: the real class's results, bit for bit
        if r["fairscale"] is not None:
            assert r["adapter"] == r["fairscale"]
    assert results[0]["oss"] == results[1]["oss"]
