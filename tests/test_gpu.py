"""The CUDA lines of oss_plus on ONE GPU (marker ``gpu``: skipped with a reason without CUDA).

Two ways to put several ranks' collectives on one device:

* the pool's gloo groups (2-4 ranks) over CUDA tensors, every rank on ``cuda:0`` (gloo moves
  CUDA tensors through host memory);
* NCCL at world size 1: a fresh process from :func:`oss_plus._launch.run_local` (NCCL
  refuses two ranks on one GPU).

Every task compares with an independent reference on the same device: the unsharded
``torch.optim`` optimizer, ``torch.nn.utils.clip_grad_norm_``, DDP + the unsharded
optimizer, and bytes and dtypes measured where the sync calls ``torch.distributed``.
The same task functions run on CPU in :func:`test_gpu_tasks_hold_on_cpu`, so the test code
itself is exercised where no GPU is (see docs/benchmarks.md, "GPU").

Run them on a CUDA machine with ``tox -e gpu`` (``pytest -m gpu``).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import (
    BUCKET_CAP_MB,
    batch,
    clone_model,
    flat_params,
    make_model,
    make_overlap_model,
    transport,
    wire_traffic,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, _dist
from oss_plus.checkpoint import load_checkpoint, save_checkpoint
from oss_plus.overlap import overlap_with_ddp

CUDA = "cuda:0"
WIRES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------ helpers of the tasks
def backward_on(model: torch.nn.Module, step: int, device: str) -> None:
    """:func:`helpers.backward` with the batch on ``device``."""
    model(batch(step).to(device)).pow(2).mean().backward()


def train_on(model: torch.nn.Module, opt: Any, steps: int, device: str, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        backward_on(model, step, device)
        opt.step()


def on_device(model: torch.nn.Module, device: str) -> bool:
    return all(p.device == torch.device(device) for p in model.parameters())


def states_on(opt: OSS) -> set[str]:
    """The device types of every tensor in the inner optimizer's state."""
    return {
        v.device.type for s in opt.optim.state.values() for v in s.values() if torch.is_tensor(v)
    }


# ------------------------------------------------------------------ tasks (device-agnostic)
def sync_task(ctx: Any, device: str, wire: str | None, transport_name: str | None) -> dict:
    """One Adam step: owned params equal plain Adam's, the others its value through the wire
    dtype; what travelled, measured at the collectives; the collective device."""
    model = make_model().to(device)
    ref_model = clone_model(model)
    with transport(transport_name):
        opt = OSS(
            model.parameters(),
            optim=torch.optim.Adam,
            group=ctx.group,
            lr=0.01,
            broadcast_dtype=WIRES[wire],
        )
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    for m, o in ((model, opt), (ref_model, ref)):
        o.zero_grad()
        backward_on(m, 0, device)
    ref.step()
    with wire_traffic() as seen:
        opt.step()
    exact = []
    for p, q in zip(model.parameters(), ref_model.parameters()):
        owned = opt.param_to_rank[p] == ctx.rank
        expected = q if owned or wire is None else q.to(WIRES[wire]).to(q.dtype)
        exact.append(torch.equal(p, expected))
    moved = not torch.equal(flat_params(ref_model), flat_params(clone_model(make_model())))
    return {
        "exact": exact,
        "moved": moved,
        "via": {via for via, _, _ in seen},
        "dtypes": {dtype for _, dtype, _ in seen},
        "bytes": sum(b for _, _, b in seen),
        "comm_device": str(_dist.comm_device(ctx.group)),
        "backend": str(dist.get_backend(ctx.group)),
        "on_device": on_device(model, device),
    }


def clip_task(ctx: Any, device: str, norm_type: float, partial: bool) -> dict:
    """clip_grad_norm on ``device`` grads (sharded path, or the partial-sum path with an
    identity filter) against torch's clip_grad_norm_ on the unsharded copy."""
    model = make_model().to(device)
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    for m in (model, ref_model):
        backward_on(m, 0, device)
    kwargs = {"filter_params_fn": list} if partial else {}
    total = opt.clip_grad_norm(0.05, norm_type, **kwargs)
    ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05, norm_type)
    grads_ok = all(
        torch.allclose(p.grad, q.grad, rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), ref_model.parameters())
        if opt.param_to_rank[p] == ctx.rank
    )
    return {
        "total": total.item(),
        "ref": ref_total.item(),
        "device": str(total.device),
        "grads_ok": grads_ok,
    }


def fused_task(ctx: Any, device: str, option: str) -> dict:
    """AdamW(fused=True / capturable=True): train, reload the state into a new OSS, train on;
    the state stays on the params' device and every step equals the plain AdamW's."""
    kwargs = {"lr": 0.01, option: True}
    model = make_model().to(device)
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, group=ctx.group, **kwargs)
    ref = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    train_on(model, opt, 2, device)
    train_on(ref_model, ref, 2, device)
    sd = copy.deepcopy(opt.state_dict(all_ranks=True))
    again = clone_model(model)
    reloaded = OSS(again.parameters(), optim=torch.optim.AdamW, group=ctx.group, **kwargs)
    reloaded.load_state_dict(sd)
    placed = states_on(reloaded)
    train_on(again, reloaded, 2, device, start=2)
    train_on(ref_model, ref, 2, device, start=2)
    return {"placed": placed, "exact": torch.equal(flat_params(again), flat_params(ref_model))}


def checkpoint_task(ctx: Any, device: str, path: str, sharded: bool, blocking: bool) -> dict:
    """Save a checkpoint from state on ``device`` (blocking or asynchronous), load it into a
    new OSS; the state comes back on the params' device and training goes on like plain
    Adam's."""
    model = make_model().to(device)
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    train_on(model, opt, 2, device)
    train_on(ref_model, ref, 2, device)
    future = save_checkpoint(opt, path, sharded=sharded, blocking=blocking)
    if future is not None:
        future.result(timeout=60)
    again = clone_model(model)
    loaded = OSS(again.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.5)
    load_checkpoint(loaded, path)
    placed = states_on(loaded)
    train_on(again, loaded, 2, device, start=2)
    train_on(ref_model, ref, 2, device, start=2)
    return {"placed": placed, "exact": torch.equal(flat_params(again), flat_params(ref_model))}


def overlap_task(ctx: Any, device: str) -> list[bool]:
    """The step inside DDP's comm hook on ``device`` against DDP + plain Adam, per iteration."""
    model = make_overlap_model().to(device)
    ddp = DDP(copy.deepcopy(model), process_group=ctx.group, bucket_cap_mb=BUCKET_CAP_MB)
    ref = DDP(copy.deepcopy(model), process_group=ctx.group, bucket_cap_mb=BUCKET_CAP_MB)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = OSS(ddp.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    overlap_with_ddp(ddp, opt)
    out = []
    for it in range(4):
        gen = torch.Generator().manual_seed(1000 * ctx.rank + it)
        x = torch.randn(5, 6, generator=gen).to(device)
        for d, o in ((ref, ref_opt), (ddp, opt)):
            o.zero_grad()
            d(x).pow(2).mean().backward()
        ref_opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref.parameters())))
    return out


TASKS = {
    "sync": sync_task,
    "clip": clip_task,
    "fused": fused_task,
    "checkpoint": checkpoint_task,
    "overlap": overlap_task,
}


def nccl_rank(rank: int, world: int, name: str, *args: Any) -> Any:
    """Entry of :func:`oss_plus._launch.run_local` with ``backend="nccl"``: the task ``name``
    over WORLD on ``cuda:<rank>``."""
    ctx = SimpleNamespace(group=dist.group.WORLD, rank=rank, world_size=world)
    return TASKS[name](ctx, f"cuda:{rank}", *args)


def run_nccl(name: str, *args: Any) -> Any:
    from oss_plus._launch import run_local

    return run_local(nccl_rank, 1, name, *args, backend="nccl", threads=1)[0]


# ------------------------------------------------------------------ the assertions
def check_sync(result: dict, wire: str | None, via: str, backend: str) -> None:
    assert result["on_device"] and result["moved"]
    assert all(result["exact"]), "differs from plain Adam (through the wire dtype)"
    assert result["via"] == {via}
    assert result["dtypes"] == {WIRES[wire] or torch.float32}
    assert result["bytes"] > 0
    assert result["backend"] == backend
    assert result["comm_device"] == ("cuda:0" if backend == "nccl" else "cpu")


def check_clip(result: dict, device: str) -> None:
    assert result["total"] == pytest.approx(result["ref"], rel=1e-6)
    assert result["ref"] > 0.05 and result["grads_ok"]
    assert result["device"] == str(torch.device(device))


# ------------------------------------------------------------------ gloo, CUDA tensors, 2-4 ranks
@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("wire", [None, "bf16", "fp16"])
@pytest.mark.parametrize("kind", [None, "broadcast", "all_gather"], ids=["auto", "bc", "ag"])
def test_gloo_sync_of_cuda_buckets(pool, world_size, wire, kind):
    """auto on gloo broadcasts (CUDA buckets too); both transports move compressed CUDA
    buckets; the collectives run on the CPU device gloo needs."""
    for r in pool.run(sync_task, CUDA, wire, kind, world_size=world_size):
        check_sync(r, wire, kind or "broadcast", "gloo")


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("partial", [False, True], ids=["sharded", "partial"])
def test_gloo_clip_of_cuda_grads(pool, norm_type, partial):
    for r in pool.run(clip_task, CUDA, norm_type, partial, world_size=3):
        check_clip(r, CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["fused", "capturable"])
def test_gloo_fused_and_capturable_state_reloads_on_the_gpu(pool, option):
    for r in pool.run(fused_task, CUDA, option, world_size=2):
        assert r["placed"] == {"cuda"} and r["exact"]


@pytest.mark.gpu
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "consolidated"])
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_gloo_checkpoint_of_cuda_state(pool, tmp_path, sharded, blocking):
    path = str(tmp_path / "ckpt")
    for r in pool.run(checkpoint_task, CUDA, path, sharded, blocking, world_size=2):
        assert r["placed"] == {"cuda"} and r["exact"]


@pytest.mark.gpu
def test_gloo_overlap_with_ddp_on_cuda(pool):
    for r in pool.run(overlap_task, CUDA, world_size=2, timeout=120):
        assert r == [True] * 4


# ------------------------------------------------------------------ NCCL, world size 1
@pytest.mark.gpu
@pytest.mark.parametrize("wire", [None, "bf16"])
@pytest.mark.parametrize("kind", [None, "all_gather"], ids=["auto", "ag"])
def test_nccl_sync(wire, kind):
    """At world size 1 auto broadcasts (all_gather is chosen on NCCL from 2 ranks up: not
    checkable on one GPU); an explicit all_gather works; the collective device is cuda:0."""
    check_sync(run_nccl("sync", wire, kind), wire, kind or "broadcast", "nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_nccl_clip(norm_type):
    check_clip(run_nccl("clip", norm_type, False), CUDA)
    check_clip(run_nccl("clip", norm_type, True), CUDA)


@pytest.mark.gpu
def test_nccl_fused_state_and_checkpoints(tmp_path):
    for option in ("fused", "capturable"):
        r = run_nccl("fused", option)
        assert r["placed"] == {"cuda"} and r["exact"], option
    for blocking in (True, False):
        r = run_nccl("checkpoint", str(tmp_path / f"ckpt-{blocking}"), True, blocking)
        assert r["placed"] == {"cuda"} and r["exact"], blocking


@pytest.mark.gpu
def test_nccl_overlap_with_ddp():
    assert run_nccl("overlap") == [True] * 4


# ------------------------------------------------------------------ the same tasks on CPU
def test_gpu_tasks_hold_on_cpu(pool, tmp_path):
    """The GPU tasks and their checks with ``device="cpu"`` (gloo): the test code itself is
    right where no GPU is, and fails on a no-op like every other test."""
    for kind in (None, "all_gather"):
        for r in pool.run(sync_task, "cpu", "bf16", kind, world_size=2):
            check_sync(r, "bf16", kind or "broadcast", "gloo")
    for r in pool.run(clip_task, "cpu", math.inf, True, world_size=2):
        check_clip(r, "cpu")
    for r in pool.run(fused_task, "cpu", "fused", world_size=2):
        assert r["placed"] == {"cpu"} and r["exact"]
    path = str(tmp_path / "ckpt")
    for r in pool.run(checkpoint_task, "cpu", path, False, False, world_size=2):
        assert r["placed"] == {"cpu"} and r["exact"]
    assert pool.run(overlap_task, "cpu", world_size=2) == [[True] * 4] * 2
