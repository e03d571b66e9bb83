"""Compressed parameter sync (broadcast_fp16 / broadcast_dtype), tested through OSS."""

import pytest
import torch
from helpers import (
    TRANSPORTS,
    WORLD_IDS,
    WORLDS,
    backward,
    clone_model,
    make_model,
    transport,
    wire_traffic,
)

from oss_plus import OSS
from oss_plus.wire.sync import bucket_numel, wire_dtype_for

WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def set_wire(opt, wire):
    """Select the wire the way integrations do: plain attributes, after construction."""
    opt.broadcast_fp16 = wire == "fp16"
    opt.broadcast_dtype = WIRES[wire] if wire == "bf16" else None


def near_one_params():
    return [torch.nn.Parameter(torch.ones(n)) for n in (64, 48, 32, 24, 16, 12, 8, 4)]


# ------------------------------------------------------------------ pure
def test_only_floating_params_wider_than_the_wire_are_compressed():
    assert wire_dtype_for(torch.float32, torch.float16) is torch.float16
    assert wire_dtype_for(torch.float32, torch.bfloat16) is torch.bfloat16
    assert wire_dtype_for(torch.float64, torch.bfloat16) is torch.bfloat16
    assert wire_dtype_for(torch.bfloat16, torch.float16) is None  # never upcast / re-round
    assert wire_dtype_for(torch.float16, torch.bfloat16) is None
    assert wire_dtype_for(torch.bfloat16, torch.bfloat16) is None
    assert wire_dtype_for(torch.int64, torch.float16) is None
    assert wire_dtype_for(torch.complex64, torch.float16) is None
    assert wire_dtype_for(torch.float32, None) is None


# ------------------------------------------------------------------ identical replicas, main copies
def small_updates_task(ctx, wire, via="broadcast", steps=30):
    """SGD lr 1e-4 on weights at 1.0 (grad 1 whatever the values): plain fp32 SGD is the
    exact trajectory of the main copies, and every rank must hold it rounded to the wire
    after every step (fairscale #1: the weights never move). Then one step without the wire
    must give every rank the exact values."""
    params = near_one_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = {"broadcast_fp16": True} if wire == "fp16" else {"broadcast_dtype": WIRES[wire]}
    with transport(via):
        opt = OSS(params, optim=torch.optim.SGD, group=ctx.group, lr=1e-4, **kwargs)
    ref_opt = torch.optim.SGD(ref, lr=1e-4)
    snapshots = []
    for step in range(steps + 1):
        if step == steps:
            opt.broadcast_fp16, opt.broadcast_dtype = False, None  # the wire off
        for ps, o in ((params, opt), (ref, ref_opt)):
            o.zero_grad()
            sum(p.sum() for p in ps).backward()  # grad = 1 whatever the values
            o.step()
        snapshots.append(([p.detach().clone() for p in params], [p.detach().clone() for p in ref]))
    used = opt.sync_buckets.transports() if hasattr(opt.sync_buckets, "transports") else {}
    return snapshots, used, opt.sync_buckets.main_bytes()


@pytest.mark.parametrize("world", WORLDS[1:], ids=WORLD_IDS[1:])
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_updates_below_wire_resolution_accumulate_in_the_main_copies(pool, world, wire):
    check_small_updates(pool.run(small_updates_task, wire, **world), WIRES[wire])


@pytest.mark.parametrize("via", TRANSPORTS)
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_every_transport_keeps_replicas_identical_and_main_copies_exact(pool, wire, via):
    results = pool.run(small_updates_task, wire, via, world_size=3)
    assert all(set(used) == {via} for _, used, _ in results)
    check_small_updates(results, WIRES[wire])


def check_small_updates(results, dtype):
    for snapshots, _, main_bytes in results:
        for step, (params, ref) in enumerate(snapshots[:-1]):
            for p, r, p0 in zip(params, ref, results[0][0][step][0]):
                assert torch.equal(p, r.to(dtype).float()), step  # the main copy, rounded
                assert torch.equal(p, p0)  # every replica the same, the owner's too
        assert all(not torch.equal(p, torch.ones_like(p)) for p in snapshots[-2][0])  # moved
        params, ref = snapshots[-1]  # one step without the wire: exact everywhere
        assert all(torch.equal(p, r) for p, r in zip(params, ref))
        assert main_bytes == 0  # the copies are dropped with the wire
    # What rounding the owner's own copy (fairscale) does: the weights never move.
    rounded = torch.ones(4)
    for _ in range(30):
        rounded = (rounded - 1e-4).to(dtype).float()
    assert torch.equal(rounded, torch.ones(4))


def replicas_task(ctx, wire, steps=4):
    """Adam on an MLP, against an independent reference of fp32 main params: a model whose
    params hold the main params rounded to the wire, Adam stepping the main params with the
    gradients of that model (Megatron-Core's distributed optimizer, unsharded)."""
    model = make_model()
    ref_model = clone_model(model)
    main = [torch.nn.Parameter(p.detach().clone()) for p in ref_model.parameters()]
    ref = torch.optim.Adam(main, lr=0.01)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    set_wire(opt, wire)
    snapshots, same = [], []
    for step in range(steps):
        for m in (model, ref_model):
            m.zero_grad()
            backward(m, step)
        opt.step()
        for m, p in zip(main, ref_model.parameters()):
            m.grad = p.grad
        ref.step()
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), main):
                p.copy_(m.to(WIRES[wire]))
        same.append(
            all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
        )
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    mine = [p for p in model.parameters() if opt.param_to_rank[p] == ctx.rank]
    region = bucket_numel(mine, aligned=True) + 1 if mine else 0  # and its status slot
    return same, snapshots, opt.sync_buckets.main_bytes(), region


@pytest.mark.parametrize("world", WORLDS[1:], ids=WORLD_IDS[1:])
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_every_replica_equals_the_rounded_main_params_after_every_step(pool, world, wire):
    results = pool.run(replicas_task, wire, **world)
    for same, snapshots, main_bytes, owned in results:
        assert same == [True] * len(same)
        assert all(torch.equal(a, b) for a, b in zip(snapshots, results[0][1]))
        assert main_bytes == owned * 4  # an fp32 main value each, nothing else
    assert sum(owned for *_, owned in results) >= sum(p.numel() for p in make_model().parameters())


def edited_task(ctx, wire):
    """A param changed between compressed steps (as ``model.load_state_dict`` does) keeps
    its new value: the main copy follows it; the other params continue from theirs."""
    params = near_one_params()
    opt = OSS(params, optim=torch.optim.SGD, group=ctx.group, lr=1e-4)
    set_wire(opt, wire)
    for step in range(5):
        if step == 3:
            with torch.no_grad():
                params[0].fill_(0.5)
        opt.zero_grad()
        sum(p.sum() for p in params).backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_a_param_edited_between_steps_keeps_its_new_value(pool, wire):
    dtype = WIRES[wire]
    expected = torch.full((64,), 0.5)
    for _ in range(2):
        expected = expected - 1e-4
    main = torch.ones(4)
    for _ in range(5):
        main = main - 1e-4
    for params in pool.run(edited_task, wire, world_size=2):
        assert torch.equal(params[0], expected.to(dtype).float())
        assert torch.equal(params[-1], main.to(dtype).float())


# ------------------------------------------------------------------ bytes and buffers
def bytes_task(ctx):
    model = make_model(depth=5)
    with transport("broadcast"):  # the transport whose bytes dist.broadcast sees
        opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.01)
    out = {}
    ptrs = {}
    for step, wire in enumerate(("fp32", "fp16", "bf16", "fp16", "bf16", "fp32")):
        if wire == "fp32":
            opt.broadcast_fp16, opt.broadcast_dtype = False, None
        else:
            set_wire(opt, wire)
        opt.zero_grad()
        backward(model, step)
        with wire_traffic() as seen:
            opt.step()
        out.setdefault(wire, []).append((sum(b for _, _, b in seen), {d for _, d, _ in seen}))
        out[f"{wire}-wire_bytes"] = opt.sync_buckets.wire_bytes(opt.wire_dtype)
        ptrs[step] = [
            (id(b), dt, t.data_ptr()) for b in opt.sync_buckets.buckets for dt, t in b.wire.items()
        ]
    out["ptrs"] = ptrs
    return out


def test_bytes_on_the_wire_are_halved_and_wire_buffers_are_reused(pool):
    for out in pool.run(bytes_task, world_size=3):
        (fp32, dtypes32), (fp32_again, _) = out["fp32"]
        assert dtypes32 == {torch.float32} and fp32 == fp32_again == out["fp32-wire_bytes"]
        for wire, dtype in WIRES.items():
            for sent, dtypes in out[wire]:  # broadcast_fp16 / broadcast_dtype read at every step
                assert dtypes == {dtype}
                assert sent * 2 == fp32
                assert sent == out[f"{wire}-wire_bytes"]
        ptrs = out["ptrs"]
        assert ptrs[1] and ptrs[1] == [p for p in ptrs[3] if p[1] == torch.float16]
        assert ptrs[2] == ptrs[3] == ptrs[4] == ptrs[5]  # nothing allocated by later steps
        assert {p[1] for p in ptrs[5]} == set(WIRES.values())


# ------------------------------------------------------------------ low-precision and mixed params
def bf16_params_task(ctx, wire):
    model = make_model().to(torch.bfloat16)
    ref_model = clone_model(model)
    with transport("broadcast"):
        opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
    set_wire(opt, wire)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    with wire_traffic() as seen:
        for step in range(3):
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
                m(x.bfloat16()).float().pow(2).mean().backward()
                o.step()
    exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    sent = sum(b for _, _, b in seen) // 3
    dtypes = [p.dtype for p in model.parameters()]
    return dtypes, {d for _, d, _ in seen}, exact, sent, opt.sync_buckets.wire_bytes(None)


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_bf16_params_stay_bf16_and_travel_uncompressed(pool, wire):
    results = pool.run(bf16_params_task, wire, world_size=2)
    for dtypes, wire_dtypes, exact, sent, uncompressed in results:
        assert set(dtypes) == {torch.bfloat16}  # fairscale turns them into fp32
        assert wire_dtypes == {torch.bfloat16}
        assert sent == uncompressed
        assert exact  # nothing rounded: bit-identical to the unsharded bf16 SGD


def mixed_task(ctx, wire):
    torch.manual_seed(0)
    specs = [
        (40, torch.float32),
        (33, torch.bfloat16),
        (20, torch.float64),
        (17, torch.float32),
        (9, torch.bfloat16),
        (5, torch.float16),
    ]
    params = [torch.nn.Parameter((torch.rand(n) + 0.5).to(dt)) for n, dt in specs]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with transport("broadcast"):
        opt = OSS(params, optim=torch.optim.SGD, group=ctx.group, lr=1e-3)
    set_wire(opt, wire)
    ref_opt = torch.optim.SGD(ref, lr=1e-3)
    with wire_traffic() as seen:
        for step in range(3):
            for ps, o in ((params, opt), (ref, ref_opt)):
                o.zero_grad()
                sum((p.double() * (i + step + 1)).sum() for i, p in enumerate(ps)).backward()
                o.step()
    owned = [opt.param_to_rank[p] == ctx.rank for p in params]
    by_dtype = {}
    for b in opt.sync_buckets.buckets:
        # the params' region and the one-element status slot travel
        by_dtype[b.buffer.dtype] = by_dtype.get(b.buffer.dtype, 0) + b.buffer.numel() + 1
    return {
        "owned": owned,
        "params": [p.detach().clone() for p in params],
        "ref": [p.detach().clone() for p in ref],
        "sent": sum(b for _, _, b in seen) // 3,
        "wire_bytes": opt.sync_buckets.wire_bytes(WIRES[wire]),
        "numel": by_dtype,
        "wire_dtypes": {d for _, d, _ in seen},
    }


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_mixed_dtype_model_compresses_only_the_wider_params(pool, world, wire):
    dtype = WIRES[wire]
    results = pool.run(mixed_task, wire, **world)
    n = len(results[0]["params"])
    owners = [next(r for r, res in enumerate(results) if res["owned"][i]) for i in range(n)]
    for res in results:
        for i, (p, r) in enumerate(zip(res["params"], res["ref"])):
            assert p.dtype == r.dtype  # no param changes dtype
            if wire_dtype_for(p.dtype, dtype) is None:
                assert torch.equal(p, r)  # travelled as itself
            else:  # the gradients do not depend on the values: SGD is the main copy
                assert torch.equal(p, r.to(dtype).to(p.dtype))
            assert torch.equal(p, results[owners[i]]["params"][i])  # the owner's too
        numel = res["numel"]
        expected = sum(numel.values()) * 2  # every bucket: 2 bytes per element on the wire
        assert res["sent"] == res["wire_bytes"] == expected
        narrow = {torch.float16, torch.bfloat16} - {dtype}
        assert res["wire_dtypes"] == {dtype} | (narrow & set(numel))


# ------------------------------------------------ world size 1: nothing to compress
class _DtypesSeen(torch.overrides.TorchFunctionMode):
    """Records the dtypes of every tensor given to, or made by, a torch function."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        values = [*args, *(kwargs or {}).values(), out]
        for v in values:
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.dtype)
        return out


def world_one_wire_task(ctx, wire):
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    set_wire(opt, wire)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    seen = set()
    for step in range(3):
        for m in (model, ref_model):
            m.zero_grad()
            backward(m, step)
        with _DtypesSeen() as mode:
            opt.step()
        seen |= mode.seen
        ref.step()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    return same, seen, opt.sync_buckets.main_bytes(), opt.sync_buckets.wire_bytes(WIRES[wire])


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_at_world_size_1_a_compressed_wire_steps_as_the_fp32_one(pool, wire):
    """One rank has no replica to send to: the compressed wire's step is the plain step
    (bit-identical to the unsharded Adam), rounds nothing (no tensor of the wire's dtype
    reaches a torch function during the step), keeps no main copy and has no wire: on any
    device it costs what the fp32 step costs."""
    ((same, seen, main_bytes, wire_bytes),) = pool.run(world_one_wire_task, wire, world_size=1)
    assert same
    assert WIRES[wire] not in seen and torch.float32 in seen  # the mode did see the step
    assert main_bytes == 0 and wire_bytes == 0
