"""Two "nodes" on this machine: two torchrun launchers joined by a c10d rendezvous on
127.0.0.1, 2 ranks each, running examples/hybrid_train.py (shard groups = the launch's
nodes, from LOCAL_WORLD_SIZE). The result is checked against a single-node run of 4 ranks
(one shard group of 4: plain ZeRO-2), which differs only in the gradients' summation order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oss_plus.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "hybrid_train.py")
STEPS = "4"


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 300) -> str:
    out = ""
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-3000:]
            out += stdout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.timeout(600)  # 10 processes importing torch: about 2 minutes on 2 busy cores
def test_two_node_launch_with_hybrid_groups_matches_one_node(tmp_path):
    port = free_port()
    multi, single = tmp_path / "multi.bin", tmp_path / "single.bin"
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "2",
                "--node_rank",
                str(node),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "oss-plus-test",
                EXAMPLE,
                "--steps",
                STEPS,
                "--out",
                str(multi),
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    out = _finish(launchers)
    assert "hybrid ZeRO-2: 2 replica set(s) x 2 shard(s)" in out
    one_node = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         EXAMPLE, "--steps", STEPS, "--out", str(single)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert "hybrid ZeRO-2: 1 replica set(s) x 4 shard(s)" in _finish([one_node])
    a, b = np.fromfile(multi, dtype=np.float32), np.fromfile(single, dtype=np.float32)
    assert a.shape == b.shape and a.size > 0
    assert np.abs(a - b).max() < 1e-5  # summation order only
    assert np.abs(a - _initial()).max() > 1e-4  # it trained


def _initial() -> np.ndarray:
    """The example's model before training (seeded, the same on every rank)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from _common import model
    finally:
        sys.path.remove(str(ROOT / "examples"))
    import torch

    params = model(torch.device("cpu")).parameters()
    return torch.cat([p.detach().reshape(-1) for p in params]).numpy()
