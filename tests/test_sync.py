"""Parameter sync transports (broadcast, all_gather), tested through OSS."""

import pytest
import torch
from helpers import (
    SGD_AND_ADAM,
    TRANSPORTS,
    WORLD_IDS,
    WORLDS,
    clone_model,
    flat_params,
    make_model,
    train_in_lockstep,
    transport,
    wire_traffic,
)
from torch.profiler import ProfilerActivity, profile

from oss_plus import OSS
from oss_plus.wire import sync
from oss_plus.wire.layout import owner_buckets
from oss_plus.wire.sync import (
    BAD_TRANSPORT,
    TRANSPORT_ENV,
    BucketSync,
    Transport,
    bucket_numel,
)
from oss_plus.wire.transport import requested

WIRES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def set_grads(model):
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)


def expected_via(kind, world_size):
    """The transports in use: ``kind``, or none at world size 1 (nothing travels)."""
    return {kind} if world_size > 1 else set()


# ------------------------------------------------------------------ pure
def test_transport_names_are_validated_and_the_env_var_overrides_auto(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert requested("auto") is Transport.AUTO
    assert requested(Transport.ALL_GATHER) is Transport.ALL_GATHER
    with pytest.raises(ValueError, match="transport must be one of") as err:
        requested("nccl")
    assert str(err.value) == BAD_TRANSPORT.format(where="transport", value="nccl")
    monkeypatch.setenv(TRANSPORT_ENV, "broadcast")
    assert requested("auto") is Transport.BROADCAST
    assert requested("all_gather") is Transport.ALL_GATHER  # explicit beats the env
    monkeypatch.setenv(TRANSPORT_ENV, "shm")  # no transport of our own
    with pytest.raises(ValueError, match=TRANSPORT_ENV):
        requested("auto")


def test_bucket_numel_pads_every_param_to_the_allocator_alignment():
    params = [torch.zeros(3), torch.zeros(16), torch.zeros(17)]
    assert bucket_numel(params, aligned=True) == 16 + 16 + 32
    assert bucket_numel(params, aligned=False) == 36
    assert bucket_numel([], aligned=True) == 0


# ------------------------------------------------------------------ parity on every transport
def parity_task(ctx, kind, name, steps=3):
    optim, kwargs = SGD_AND_ADAM[name]
    model = make_model()
    ref_model = clone_model(model)
    with transport(kind):
        opt = OSS(model.parameters(), optim=optim, group=ctx.group, **kwargs)
    ref = optim(ref_model.parameters(), **kwargs)
    exact = train_in_lockstep(model, opt, ref_model, ref, steps)
    return {"exact": exact, "params": flat_params(model), "via": opt.sync_buckets.transports()}


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_transport_is_bit_identical_to_the_unsharded_optimizer(pool, world, kind):
    for name in ("adam", "sgd"):
        results = pool.run(parity_task, kind, name, **world)
        size = len(results)
        for rank, r in enumerate(results):
            assert set(r["via"]) == expected_via(kind, size), r["via"]
            assert all(r["exact"]), f"rank {rank} diverged with {kind}/{name}: {r['exact']}"
            assert torch.equal(r["params"], results[0]["params"])


def auto_task(ctx, width):
    model = make_model(width=width)
    with transport(None):
        opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    return opt.sync_buckets.transports(), opt.sync_buckets.wire_bytes()


def test_auto_broadcasts_cpu_buckets_on_gloo(pool):
    for width in (6, 400):  # small and ~1.3 MB of fp32 params
        for via, _ in pool.run(auto_task, width, world_size=2):
            assert set(via) == {"broadcast"}
    assert pool.run(auto_task, 400, world_size=1)[0] == ({}, 0)  # nothing travels


# ------------------------------------------------------------------ compression
def compressed_task(ctx, kind, wire):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.rand(n) + 0.5) for n in (300, 200, 130, 70, 33)]
    with transport(kind):
        opt = OSS(
            params, optim=torch.optim.SGD, group=ctx.group, lr=1e-4, broadcast_dtype=WIRES[wire]
        )
    exact = [p.detach().clone() for p in params]
    traffic, rounded = [], []
    for step in range(3):
        opt.zero_grad()
        sum((p * (i + step + 1)).sum() for i, p in enumerate(params)).backward()
        with wire_traffic() as seen:
            opt.step()
        traffic.append(seen)
        with torch.no_grad():
            for i, e in enumerate(exact):
                e.sub_(1e-4 * (i + step + 1))  # plain SGD: the main copies, exact
        rounded.append(
            all(torch.equal(p, e.to(WIRES[wire]).float()) for p, e in zip(params, exact))
        )
    owned = [opt.param_to_rank[p] == ctx.rank for p in params]
    values = [p.detach().clone() for p in params]
    opt.broadcast_dtype = None  # one more step, uncompressed: exact values everywhere
    with wire_traffic() as seen:
        opt.step()
    with torch.no_grad():
        for i, e in enumerate(exact):
            e.sub_(1e-4 * (i + 3))  # the last gradients again
    after = [torch.equal(p, e) for p, e in zip(params, exact)]
    full = sum(b for _, _, b in seen)
    sent = [sum(b for _, _, b in seen) for seen in traffic]  # measured at the collectives
    dtypes = {d for seen in traffic for _, d, _ in seen}
    return (
        owned,
        values,
        (rounded, after),
        sent,
        (full, dtypes),
        {via for seen in traffic for via, _, _ in seen},
    )


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
def test_every_replica_holds_the_main_values_rounded_and_no_wire_makes_them_exact(
    pool, kind, wire, world
):
    results = pool.run(compressed_task, kind, wire, **world)
    for _, values, (rounded, after), sent, (full, dtypes), via in results:
        assert via == {kind}  # the collective the transport names was called
        assert dtypes == {WIRES[wire]}  # only the wire dtype travelled
        assert sent == [full // 2] * 3  # half the bytes of an uncompressed sync, every step
        assert rounded == [True] * 3  # every rank, the owner too: the main values, rounded
        assert after == [True] * len(after)  # the wire off: exact values everywhere
        assert all(torch.equal(v, w) for v, w in zip(values, results[0][1]))


def mixed_dtypes_task(ctx, wire):
    torch.manual_seed(0)
    specs = [(40, torch.float32), (33, torch.bfloat16), (20, torch.float64), (17, torch.float32)]
    params = [torch.nn.Parameter((torch.rand(n) + 0.5).to(dt)) for n, dt in specs]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with transport("broadcast"):
        opt = OSS(
            params, optim=torch.optim.SGD, group=ctx.group, lr=1e-3, broadcast_dtype=WIRES[wire]
        )
    ref_opt = torch.optim.SGD(ref, lr=1e-3)
    for step in range(2):
        for ps, o in ((params, opt), (ref, ref_opt)):
            o.zero_grad()
            sum((p.double() * (i + step + 1)).sum() for i, p in enumerate(ps)).backward()
            o.step()
    owners = [opt.param_to_rank[p] for p in params]
    return (
        owners,
        [p.detach().clone() for p in params],
        [p.detach().clone() for p in ref],
        opt.sync_buckets.transports(),
    )


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_mixed_dtypes_only_wider_params_are_rounded(pool, wire):
    results = pool.run(mixed_dtypes_task, wire, world_size=3)
    for _, values, ref, via in results:
        assert set(via) == {"broadcast"}
        for value, expected in zip(values, ref):
            assert value.dtype == expected.dtype
            narrow = sync.wire_dtype_for(value.dtype, WIRES[wire])
            if narrow is None:
                assert torch.equal(value, expected)
            else:
                assert torch.equal(value, expected.to(narrow).to(value.dtype))


# ------------------------------------------------------------------ memory and resources
def sync_allocations(prof):
    """Bytes allocated by ops running inside an ``oss_plus::sync`` range."""
    total = 0
    for event in prof.events():
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if any(n.startswith("oss_plus::sync") for n in names):
            total += max(0, event.self_cpu_memory_usage)
    return total


def allocation_task(ctx, kind, wire, steps=100):
    model = make_model(width=16)
    with transport(kind):
        opt = OSS(
            model.parameters(),
            optim=torch.optim.SGD,
            group=ctx.group,
            lr=0.01,
            broadcast_dtype=WIRES[wire],
        )
    set_grads(model)
    opt.step()  # wire buffers are allocated on first use
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            opt.step()
    seen = sum(1 for e in prof.events() if e.name == "oss_plus::sync")
    return sync_allocations(prof), seen, opt.sync_buckets.transports()


# all_gather is the NCCL default; gloo's all_gather allocates its output inside torch itself
@pytest.mark.parametrize("kind", ["broadcast"])
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_the_sync_path_allocates_nothing_over_100_steps(pool, kind, wire):
    for allocated, seen, via in pool.run(allocation_task, kind, wire, world_size=2):
        assert set(via) == {kind}
        assert seen == 100  # the counter did see every sync
        assert allocated == 0


def all_gather_layout_task(ctx):
    params = list(make_model().parameters())
    by_owner = [params[r :: ctx.world_size] for r in range(ctx.world_size)]
    keys = sync.gathered_keys(by_owner, "all_gather", ctx.group)
    buckets, gathers = owner_buckets(by_owner, aligned=True, gathered=keys)
    layout = BucketSync(buckets, ctx.group, gathers)
    regions = {g.region for g in layout.gathers}
    flats = [g.flat.numel() for g in layout.gathers]
    return regions, layout.wire_bytes(), layout.wire_bytes(torch.bfloat16), flats


def test_all_gather_pads_every_rank_to_one_region_size(pool):
    for regions, fp32, bf16, flats in pool.run(all_gather_layout_task, world_size=3):
        (region,) = regions
        assert region % 16 == 0  # 64-byte aligned fp32 regions
        assert flats == [3 * region] and fp32 == 3 * region * 4 and bf16 * 2 == fp32
