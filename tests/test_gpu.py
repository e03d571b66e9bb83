"""The CUDA lines of oss_plus on ONE GPU (marker ``gpu``: skipped with a reason without CUDA).

Two ways to put several ranks' collectives on one device:

* the pool's gloo groups (2-4 ranks) over CUDA tensors, every rank on ``cuda:0`` (gloo moves
  CUDA tensors through host memory);
* NCCL at world size 1: a fresh process from :func:`oss_plus.runtime.launch.run_local` (NCCL
  refuses two ranks on one GPU).

Every task compares with an independent reference on the same device: the unsharded
``torch.optim`` optimizer (its state placement too), ``torch.nn.utils.clip_grad_norm_``,
DDP + the unsharded optimizer (+ ``GradScaler``), and bytes, dtypes and device-to-host syncs
measured where they happen. Every task runs under :class:`device_guard.StrictDevices`: a
comparison of a tensor whose device was never chosen, or of two devices, fails. The same
tasks run on CPU in :func:`test_gpu_tasks_hold_on_cpu`, so the test code itself is exercised
(and a device mix-up caught) where no GPU is (see docs/benchmarks.md, "GPU").

Run them on a CUDA machine with ``tox -e gpu`` (``pytest -m gpu``).
"""

from __future__ import annotations

import copy
import functools
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from device_guard import IMPLICIT, StrictDevices
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

from oss_plus import OSS, ShardedDataParallel, ShardedGradScaler
from oss_plus.bench.measure import count_syncs
from oss_plus.checkpoint import load_checkpoint, save_checkpoint
from oss_plus.overlap import overlap_with_ddp
from oss_plus.runtime import dist as _dist

CUDA = "cuda:0"
WIRES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------ helpers of the tasks
def backward_on(model: torch.nn.Module, step: int, device: str) -> None:
    """:func:`helpers.backward` with the batch on ``device``."""
    model(batch(step).to(device)).pow(2).mean().backward()


def model_on(device: str, **kwargs: Any) -> torch.nn.Module:
    """:func:`helpers.make_model` (same values on every device), moved to ``device``."""
    return make_model(**kwargs).to(device)


def train_on(model: torch.nn.Module, opt: Any, steps: int, device: str, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        backward_on(model, step, device)
        opt.step()


def on_device(model: torch.nn.Module, device: str) -> bool:
    return all(p.device == torch.device(device) for p in model.parameters())


def states_on(opt: Any) -> set[str]:
    """The device types of every tensor in an optimizer's state (an OSS: its inner one's)."""
    state = getattr(opt, "optim", opt).state
    return {v.device.type for s in state.values() for v in s.values() if torch.is_tensor(v)}


# ------------------------------------------------------------------ tasks (device-agnostic)
def sync_task(ctx: Any, device: str, wire: str | None, transport_name: str | None) -> dict:
    """One Adam step: every param equals plain Adam's value through the wire dtype (the
    owner's too: issue 27, identical replicas; exact at world size 1, where nothing
    travels); what travelled, measured at the collectives; the collective device."""
    model = model_on(device)
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
        rounded = wire is not None and ctx.world_size > 1  # at 1 nothing travels
        expected = q.to(WIRES[wire]).to(q.dtype) if rounded else q
        exact.append(torch.equal(p, expected))
    moved = not torch.equal(flat_params(ref_model), flat_params(model_on(device)))
    return {
        "world_size": ctx.world_size,
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
    identity filter) against torch's clip_grad_norm_ on the unsharded copy; the total is
    returned on the gradients' device, as torch's."""
    model = model_on(device)
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
        "ref_device": str(ref_total.device),
        "grads_ok": grads_ok,
    }


def fused_task(ctx: Any, device: str, option: str) -> dict:
    """AdamW(fused=True / capturable=True): train, reload the state into a new OSS, train on;
    the state is placed as the plain AdamW places it and every step equals the plain AdamW's."""
    kwargs = {"lr": 0.01, option: True}
    model = model_on(device)
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
    exact = torch.equal(flat_params(again), flat_params(ref_model))
    return {"placed": placed, "ref_placed": states_on(ref), "exact": exact}


def checkpoint_task(ctx: Any, device: str, path: str, sharded: bool, blocking: bool) -> dict:
    """Save a checkpoint from state on ``device`` (blocking or asynchronous: the pinned
    staging path on CUDA), load it into a new OSS; the state comes back placed as plain
    Adam places it (``step`` on the CPU unless fused/capturable) and training goes on like
    plain Adam's."""
    model = model_on(device)
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
    exact = torch.equal(flat_params(again), flat_params(ref_model))
    return {"placed": placed, "ref_placed": states_on(ref), "exact": exact}


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
        x = torch.randn(5, 6, generator=gen, device="cpu").to(device)
        for d, o in ((ref, ref_opt), (ddp, opt)):
            o.zero_grad()
            d(x).pow(2).mean().backward()
        ref_opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref.parameters())))
    return out


#: max_norm of the amp tasks: small enough that every step clips.
AMP_CLIP = 0.02


def amp_step(model: Any, opt: Any, scaler: Any, x: torch.Tensor, clip: Any, group: Any):
    """One fp16-autocast step with clipping; with ``group``, grads are averaged over it by
    hand (as DDP does). Returns the loss and the total norm before clipping."""
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if group is not None:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))
    scaler.unscale_(opt)
    total = clip(AMP_CLIP)
    scaler.step(opt)
    scaler.update()
    return loss.item(), total.item()


def amp_task(ctx: Any, device: str, wire: str | None) -> dict:
    """fp16 autocast + ShardedGradScaler + clip_grad_norm (+ a compressed wire) against DDP
    with plain AdamW, torch's GradScaler and clip_grad_norm_; each rank its own batch."""
    model, ref = model_on(device), DDP(model_on(device), process_group=ctx.group)
    kind = torch.device(device).type
    opt = OSS(
        model.parameters(),
        optim=torch.optim.AdamW,
        group=ctx.group,
        lr=0.01,
        broadcast_dtype=WIRES[wire],
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    scaler = ShardedGradScaler(kind, init_scale=2.0**12, growth_interval=2)
    ref_scaler = torch.amp.GradScaler(kind, init_scale=2.0**12, growth_interval=2)
    ref_clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(ref.parameters()))
    losses = []
    for step in range(6):
        x = batch(step, rank=ctx.rank).to(device)
        ours = amp_step(model, opt, scaler, x, opt.clip_grad_norm, ctx.group)
        losses.append((*ours, *amp_step(ref, ref_opt, ref_scaler, x, ref_clip, None)))
    return {"losses": losses, "scales": (scaler.get_scale(), ref_scaler.get_scale())}


def sdp_task(ctx: Any, device: str) -> list[bool]:
    """ShardedDataParallel (ZeRO-2) + OSS on ``device`` against DDP + OSS, per iteration."""
    model = model_on(device)
    ref = DDP(clone_model(model), process_group=ctx.group)
    ref_opt = OSS(ref.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    sdp = ShardedDataParallel(model, opt, process_group=ctx.group)
    out = []
    for step in range(3):
        x = batch(step, rank=ctx.rank).to(device)
        for m, o in ((sdp, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        out.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())))
    return out


def sdp_unused_task(ctx: Any, device: str) -> dict:
    """ZeRO-2 with params unused on some ranks (``branch``) on ``device``, the used flags
    travelling in the buckets: gradients against DDP with ``find_unused_parameters=True``
    + OSS at every iteration, and the host syncs of each backward: one on a rank that owns
    a param it got no gradient for (it reads the summed flags), none elsewhere (the flags
    are written on the device)."""
    from sdp_utils import Net
    from sdp_utils import batch as sdp_batch

    torch.manual_seed(0)
    model = Net(branch=True).to(device)
    model.never.requires_grad_(False)  # else both ranks own a param no rank uses: always 1
    ref = DDP(copy.deepcopy(model), process_group=ctx.group, find_unused_parameters=True)
    ref_opt = OSS(ref.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    sdp = ShardedDataParallel(model, opt, process_group=ctx.group)
    syncs, expected, grads = [], [], []
    for step in range(4):
        use = (step + ctx.rank) % 2 == 0
        x = sdp_batch(step, ctx.rank).to(device)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = sdp(x, use_branch=use).pow(2).mean()
        syncs.append(count_syncs(loss.backward, torch.device(device)))
        ref(x, use_branch=use).pow(2).mean().backward()
        used = [model.fc1, model.fc2, model.head, *([model.branch] if use else [])]
        local = {id(p) for m in used for p in m.parameters()}
        owners = opt.param_to_rank
        missing = [p for p in model.parameters() if p.requires_grad and id(p) not in local]
        expected.append(int(any(owners[p] == ctx.rank for p in missing)))
        grads.append(
            all(
                (p.grad is None and q.grad is None)
                or (p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
                if owners[p] == ctx.rank
                else p.grad is None
                for p, q in zip(model.parameters(), ref.module.parameters())
            )
        )
        opt.step()
        ref_opt.step()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.module.parameters()))
    return {"syncs": syncs, "expected": expected, "grads": grads, "params": same}


def check_sdp_unused(results: list[dict]) -> None:
    for result in results:
        assert all(result["grads"]) and result["params"], result
        assert result["syncs"] == result["expected"], result
    expected = [e for r in results for e in r["expected"]]
    assert 0 in expected and 1 in expected, "both cases must occur"


def syncs_task(ctx: Any, device: str) -> list[int]:
    """Device-to-host syncs of OSS.step beyond plain SGD's (``set_sync_debug_mode`` on CUDA,
    host reads on the CPU), per step: none at any world size (issue 27)."""
    model = model_on(device)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, momentum=0.9)
    counts = []
    for step in range(3):
        opt.zero_grad()
        backward_on(model, step, device)
        counts.append(count_syncs(opt.step, torch.device(device)))
    return counts


def flat_task(ctx: Any, device: str, sdp: bool) -> dict:
    """The flat rule on ``device`` under DDP (or ShardedDataParallel) against DDP + plain
    SGD: params cut inside (64-byte alignment on CPU, 512 on CUDA: the layers are wide
    enough either way), three steps compared bit for bit, and the step's host syncs (SGD
    with momentum reads nothing itself; Adam reads its ``step`` counts on CPU)."""
    model = model_on(device, width=26)  # cut inside a param at both alignments (2 ranks)
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, momentum=0.9,
              partition_rule="flat")  # fmt: skip
    net = ShardedDataParallel(model, opt, ctx.group) if sdp else DDP(model, process_group=ctx.group)
    ref_net = DDP(ref_model, process_group=ctx.group)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    exact, syncs = [], []
    for step in range(3):
        x = batch(step, width=26, rank=ctx.rank).to(device)
        for m, o in ((net, opt), (ref_net, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        syncs.append(count_syncs(opt.step, torch.device(device)))
        ref.step()
        exact.append(torch.equal(flat_params(model), flat_params(ref_model)))
    return {"exact": exact, "syncs": syncs, "split": len(opt.plan.split), "world": ctx.world_size}


def check_flat(result: dict) -> None:
    assert all(result["exact"]), result
    assert result["split"] > 0 or result["world"] == 1
    check_syncs(result["syncs"], result["world"])


TASKS = {
    "flat": flat_task,
    "sync": sync_task,
    "clip": clip_task,
    "fused": fused_task,
    "checkpoint": checkpoint_task,
    "overlap": overlap_task,
    "amp": amp_task,
    "sdp": sdp_task,
    "sdp_unused": sdp_unused_task,
    "syncs": syncs_task,
}


def strict(ctx: Any, name: str, *args: Any) -> Any:
    """Run the task ``name`` under :class:`StrictDevices` (what every test ships to ranks)."""
    with StrictDevices():
        return TASKS[name](ctx, *args)


def nccl_rank(rank: int, world: int, name: str, *args: Any) -> Any:
    """Entry of :func:`oss_plus.runtime.launch.run_local` with ``backend="nccl"``: the task ``name``
    over WORLD on ``cuda:<rank>``."""
    ctx = SimpleNamespace(group=dist.group.WORLD, rank=rank, world_size=world)
    return strict(ctx, name, f"cuda:{rank}", *args)


def run_nccl(name: str, *args: Any) -> Any:
    from oss_plus.runtime.launch import run_local

    return run_local(nccl_rank, 1, name, *args, backend="nccl", threads=1)[0]


# ------------------------------------------------------------------ the assertions
def check_sync(result: dict, wire: str | None, via: str, backend: str) -> None:
    assert result["on_device"] and result["moved"]
    assert all(result["exact"]), "differs from plain Adam (through the wire dtype)"
    if result["world_size"] == 1:  # nothing travels: no collective, no wire buffer
        assert result["via"] == set() and result["bytes"] == 0
    else:
        assert result["via"] == {via}
        assert result["dtypes"] == {WIRES[wire] or torch.float32}
        assert result["bytes"] > 0
    assert result["backend"] == backend
    assert result["comm_device"] == ("cuda:0" if backend == "nccl" else "cpu")


def check_clip(result: dict, device: str) -> None:
    assert result["total"] == pytest.approx(result["ref"], rel=1e-6)
    assert result["ref"] > 0.05 and result["grads_ok"]
    assert result["device"] == result["ref_device"] == str(torch.device(device))


def check_placed(result: dict) -> None:
    """State placed as the plain optimizer places it, and the same training."""
    assert result["placed"] == result["ref_placed"] and result["exact"]


def check_amp(result: dict) -> None:
    """Same losses and norms as DDP + GradScaler (fp16 rounding apart), clipping active."""
    for loss, total, ref_loss, ref_total in result["losses"]:
        assert loss == pytest.approx(ref_loss, abs=2e-4)
        assert total == pytest.approx(ref_total, rel=1e-3) and ref_total > AMP_CLIP
    assert result["scales"][0] == result["scales"][1]


def check_syncs(counts: list[int], world_size: int) -> None:
    """No device sync per step at any world size (issue 27: the peers' status is read from
    pinned host memory at the next check; before, one read per step above world size 1)."""
    assert counts == [0] * len(counts), (world_size, counts)


# ------------------------------------------------------------------ gloo, CUDA tensors, 2-4 ranks
@pytest.mark.gpu
@pytest.mark.parametrize("sdp", [False, True], ids=["ddp", "sdp"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_gloo_flat_rule_on_cuda(pool, world_size, sdp):
    for r in pool.run(strict, "flat", CUDA, sdp, world_size=world_size):
        check_flat(r)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("wire", [None, "bf16", "fp16"])
@pytest.mark.parametrize("kind", [None, "broadcast", "all_gather"], ids=["auto", "bc", "ag"])
def test_gloo_sync_of_cuda_buckets(pool, world_size, wire, kind):
    """auto on gloo broadcasts (CUDA buckets too); both transports move compressed CUDA
    buckets; the collectives run on the CPU device gloo needs."""
    for r in pool.run(strict, "sync", CUDA, wire, kind, world_size=world_size):
        check_sync(r, wire, kind or "broadcast", "gloo")


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("partial", [False, True], ids=["sharded", "partial"])
def test_gloo_clip_of_cuda_grads(pool, norm_type, partial):
    """The total comes back on the gradients' device although gloo reduces on the CPU."""
    for r in pool.run(strict, "clip", CUDA, norm_type, partial, world_size=3):
        check_clip(r, CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["fused", "capturable"])
def test_gloo_fused_and_capturable_state_reloads_on_the_gpu(pool, option):
    for r in pool.run(strict, "fused", CUDA, option, world_size=2):
        check_placed(r)
        assert "cuda" in r["placed"]


@pytest.mark.gpu
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "consolidated"])
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_gloo_checkpoint_of_cuda_state(pool, tmp_path, sharded, blocking):
    path = str(tmp_path / "ckpt")
    for r in pool.run(strict, "checkpoint", CUDA, path, sharded, blocking, world_size=2):
        check_placed(r)  # Adam keeps ``step`` on the CPU: {"cpu", "cuda"}, as torch's


@pytest.mark.gpu
def test_gloo_overlap_with_ddp_on_cuda(pool):
    for r in pool.run(strict, "overlap", CUDA, world_size=2, timeout=120):
        assert r == [True] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("wire", [None, "fp16"])
def test_gloo_fp16_autocast_scaler_and_clip_match_ddp_with_grad_scaler(pool, wire):
    for r in pool.run(strict, "amp", CUDA, wire, world_size=2, timeout=120):
        check_amp(r)


@pytest.mark.gpu
def test_gloo_sharded_data_parallel_on_cuda_equals_ddp(pool):
    for r in pool.run(strict, "sdp", CUDA, world_size=2, timeout=120):
        assert r == [True] * 3


@pytest.mark.gpu
def test_gloo_sdp_used_flags_sync_only_where_an_owner_lacks_a_gradient(pool):
    check_sdp_unused(pool.run(strict, "sdp_unused", CUDA, world_size=2, timeout=120))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_step_never_syncs_the_device(pool, world_size):
    for r in pool.run(strict, "syncs", CUDA, world_size=world_size):
        check_syncs(r, world_size)


# ------------------------------------------------------------------ NCCL, world size 1
@pytest.mark.gpu
@pytest.mark.parametrize("wire", [None, "bf16"])
@pytest.mark.parametrize("kind", [None, "all_gather"], ids=["auto", "ag"])
def test_nccl_sync(wire, kind):
    """At world size 1 nothing travels (no collective, no wire buffer), whatever the
    transport; the result is plain Adam's; the collective device is cuda:0."""
    check_sync(run_nccl("sync", wire, kind), wire, kind or "broadcast", "nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_nccl_clip(norm_type):
    check_clip(run_nccl("clip", norm_type, False), CUDA)
    check_clip(run_nccl("clip", norm_type, True), CUDA)


@pytest.mark.gpu
def test_nccl_fused_state_and_checkpoints(tmp_path):
    for option in ("fused", "capturable"):
        check_placed(run_nccl("fused", option))
    for blocking in (True, False):
        check_placed(run_nccl("checkpoint", str(tmp_path / f"ckpt-{blocking}"), True, blocking))


@pytest.mark.gpu
@pytest.mark.parametrize("sdp", [False, True], ids=["ddp", "sdp"])
def test_nccl_flat_rule(sdp):
    check_flat(run_nccl("flat", sdp))


@pytest.mark.gpu
def test_nccl_overlap_amp_sdp_and_no_sync_alone():
    assert run_nccl("overlap") == [True] * 4
    check_amp(run_nccl("amp", "fp16"))
    assert run_nccl("sdp") == [True] * 3
    check_syncs(run_nccl("syncs"), 1)


# ------------------------------------------------------------------ the same tasks on CPU
def test_gpu_tasks_hold_on_cpu(pool, tmp_path):
    """The GPU tasks and their checks with ``device="cpu"`` (gloo), under the same strict
    devices: the test code itself is right where no GPU is, a reference built without a
    device fails here as on a GPU, and every check fails on a no-op."""
    for kind in (None, "all_gather"):
        for r in pool.run(strict, "sync", "cpu", "bf16", kind, world_size=2):
            check_sync(r, "bf16", kind or "broadcast", "gloo")
    check_sync(pool.run(strict, "sync", "cpu", "bf16", None, world_size=1)[0], "bf16", "", "gloo")
    for r in pool.run(strict, "clip", "cpu", math.inf, True, world_size=2):
        check_clip(r, "cpu")
    for r in pool.run(strict, "fused", "cpu", "fused", world_size=2):
        check_placed(r)
    path = str(tmp_path / "ckpt")
    for r in pool.run(strict, "checkpoint", "cpu", path, False, False, world_size=2):
        check_placed(r)
    assert pool.run(strict, "overlap", "cpu", world_size=2) == [[True] * 4] * 2
    for r in pool.run(strict, "amp", "cpu", "fp16", world_size=2, timeout=120):
        check_amp(r)
    assert pool.run(strict, "sdp", "cpu", world_size=2, timeout=120) == [[True] * 3] * 2
    check_sdp_unused(pool.run(strict, "sdp_unused", "cpu", world_size=2, timeout=120))
    for world_size in (1, 2, 3):
        for r in pool.run(strict, "syncs", "cpu", world_size=world_size):
            check_syncs(r, world_size)
    for world_size in (1, 2):
        for sdp in (False, True):
            for r in pool.run(strict, "flat", "cpu", sdp, world_size=world_size):
                check_flat(r)


def test_strict_devices_catch_a_reference_built_without_a_device():
    """The mistake the GPU suite once made (sync_task compared its CUDA result with
    ``clone_model(make_model())``, built on the CPU) fails on the CPU too; the right
    reference, and a model moved by ``module.to()``'s ``p.data = moved``, pass."""
    with StrictDevices():
        model = model_on("cpu")
        with pytest.raises(AssertionError, match="never chosen") as err:
            torch.equal(flat_params(model), flat_params(clone_model(make_model())))
        assert str(err.value) == IMPLICIT.format(name="equal")
        assert torch.equal(flat_params(model), flat_params(clone_model(model_on("cpu"))))
        moved = make_model()._apply(lambda t: t.to("cpu", copy=True))  # .data = a moved copy
        assert torch.equal(flat_params(moved), flat_params(model))
        with pytest.raises(AssertionError, match="never chosen"):
            torch.allclose(torch.ones(2, device="cpu"), torch.ones(2) * 2)
