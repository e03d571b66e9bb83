"""ShardedDataParallel + OSS against DDP + OSS, on 1-4 ranks and an offset subgroup.

fp32 results are bit-identical where the sum of the per-rank gradients can be: on 1 and 2
ranks (a + b == b + a). On 3-4 ranks gloo's sum order depends on the buffer layout (DDP's
bucket vs ours), so gradients are checked against the bound any two summation orders obey
(``sdp_utils.abs_sum``) and parameters after the steps to 1e-5.
"""

import pytest
import torch
import torch.distributed as dist
from helpers import WORLD_IDS, WORLDS
from sdp_utils import BUCKETS, abs_sum, batch, flat, grads_match, max_diff, pair, same_everywhere

EXACT = {"ws1", "ws2", "offset23"}


def _loss(step, rank, use_branch=False):
    return lambda m: m(batch(step, rank), use_branch=use_branch).pow(2).mean()


def train_task(
    ctx, bucket, steps=4, accumulate=0, branch=None, freeze_at=None, twice=False, collective="auto"
):
    """Train both; optionally accumulate under no_sync, use a branch on some ranks/steps,
    freeze fc1 for steps [freeze_at, freeze_at + 2), or run two forwards per backward."""
    net = {"branch": branch is not None}
    ddp_kw = {"find_unused_parameters": branch is not None or freeze_at is not None}
    sdp, opt, ddp, ref_opt = pair(ctx, bucket, net=net, ddp=ddp_kw, collective=collective)
    checks = []
    for step in range(steps):
        if freeze_at is not None:
            frozen = freeze_at <= step < freeze_at + 2
            for m in (sdp.module, ddp.module):
                m.fc1.weight.requires_grad_(not frozen)
        use_branch = branch is not None and (step + ctx.rank * branch) % 2 == 0
        sums = abs_sum(ctx, sdp.module, _loss(step, ctx.rank, use_branch)) if step == 0 else None
        for net_, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            for micro in range(accumulate):
                with net_.no_sync():
                    net_(batch(100 + micro, ctx.rank)).pow(2).mean().backward()
            loss = net_(batch(step, ctx.rank), use_branch=use_branch).pow(2).mean()
            if twice:
                loss = loss + net_(batch(50 + step, ctx.rank)).pow(2).mean()
            loss.backward()
        checks.append(grads_match(ctx, sdp, opt, ddp, sums))
        opt.step()
        ref_opt.step()
    return {
        "checks": checks,
        "exact": torch.equal(flat(sdp.module), flat(ddp.module)),
        "diff": max_diff(sdp.module, ddp.module),
        "replicas": same_everywhere(ctx, flat(sdp.module)),
    }


def _assert_parity(results, world_id, check_within=True):
    for rank, r in enumerate(results):
        assert all(c["sharded"] for c in r["checks"]), f"rank {rank} holds grads it does not own"
        assert r["replicas"], "replicas differ"
        if world_id in EXACT:
            assert r["exact"], f"rank {rank} diverged from DDP + OSS by {r['diff']}"
            assert all(c["exact"] for c in r["checks"])
        else:
            assert r["diff"] < 1e-5, r["diff"]
            if check_within:  # same params only at the first step
                assert r["checks"][0]["within"]


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("bucket", BUCKETS)
def test_parity_with_ddp_and_oss(pool, world, bucket, collective):
    results = pool.run(train_task, bucket, collective=collective, **world)
    _assert_parity(results, WORLD_IDS[WORLDS.index(world)])


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
@pytest.mark.parametrize("bucket", BUCKETS[:2])  # 2**23 (one bucket per owner) in the parity test
@pytest.mark.parametrize(
    "scenario",
    [
        {"accumulate": 2},
        {"freeze_at": 1, "steps": 5},
        {"branch": 1},  # the branch is used on alternate ranks: unused on some ranks only
        {"branch": 0},  # used on every rank on even steps, on none on odd ones
        {"twice": True},
    ],
    ids=["no_sync", "freeze_unfreeze", "unused_some_ranks", "unused_all_ranks", "two_forwards"],
)
@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_features_match_ddp(pool, world, bucket, scenario, collective):
    results = pool.run(train_task, bucket, **scenario, collective=collective, **world)
    _assert_parity(results, "ws4" if world.get("world_size") == 4 else "ws2", False)


def _bf16_hook(group, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, group, bucket)


def compressed_task(ctx, bucket, wire, collective):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[wire]
    kwargs = {"reduce_fp16": True} if wire == "fp16" else {"reduce_dtype": dtype}
    kwargs["collective"] = collective
    sdp, opt, ddp, ref_opt = pair(ctx, bucket, **kwargs)
    # bf16_compress_hook itself is refused off CUDA; this is its body (torch's own function)
    hook = default_hooks.fp16_compress_hook if wire == "fp16" else _bf16_hook
    ddp.register_comm_hook(ctx.group, hook)
    checks = []
    for step in range(3):
        for net, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            net(batch(step, ctx.rank)).pow(2).mean().backward()
        checks.append(grads_match(ctx, sdp, opt, ddp))
        opt.step()
        ref_opt.step()
    return checks, torch.equal(flat(sdp.module), flat(ddp.module))


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_compressed_reduction_matches_ddp_compress_hooks(pool, bucket, wire, collective):
    for checks, exact in pool.run(compressed_task, bucket, wire, collective, world_size=2):
        assert exact and all(c["exact"] and c["sharded"] for c in checks)


def buffers_task(ctx, bucket):
    sdp, opt, ddp, ref_opt = pair(ctx, bucket, net={"norm": True})
    for step in range(3):
        for net, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            net(batch(step, ctx.rank)).pow(2).mean().backward()
            o.step()
    return {
        "params": torch.equal(flat(sdp.module), flat(ddp.module)),
        "buffers": all(
            torch.equal(a, b) for a, b in zip(sdp.module.buffers(), ddp.module.buffers())
        ),
    }


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_buffers_are_broadcast_like_ddp(pool, world):
    for r in pool.run(buffers_task, 64, **world):
        assert r == {"params": True, "buffers": True}


def eval_task(ctx, bucket):
    import copy

    sdp, opt, ddp, ref_opt = pair(ctx, bucket)
    local = copy.deepcopy(sdp.module)
    local(batch(1, ctx.rank)).sum().backward()
    sdp.eval()
    with torch.no_grad():
        sdp(batch(0, ctx.rank))
    opt.zero_grad()
    sdp(batch(1, ctx.rank)).sum().backward()  # eval mode: gradients stay local (fairscale)
    kept_local = all(
        torch.equal(p.grad, q.grad) for p, q in zip(sdp.module.parameters(), local.parameters())
    )
    sdp.train()
    for step in range(2):
        for net, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            net(batch(step, ctx.rank)).pow(2).mean().backward()
            o.step()
    return kept_local, torch.equal(flat(sdp.module), flat(ddp.module))


def test_eval_mode_keeps_gradients_local_then_training_resumes(pool):
    for all_local, exact in pool.run(eval_task, 64, world_size=2):
        assert all_local and exact


def amp_task(ctx, bucket, inf_rank):
    from oss_plus import ShardedGradScaler

    sdp, opt, ddp, ref_opt = pair(ctx, bucket)
    scalers = [ShardedGradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    skipped = []
    for step in range(3):
        before = flat(sdp.module)
        for (net, o), scaler in zip(((sdp, opt), (ddp, ref_opt)), scalers):
            o.zero_grad()
            scaler.scale(net(batch(step, ctx.rank)).pow(2).mean()).backward()
            head = net.module.head.weight
            if step == 1 and ctx.rank == inf_rank and head.grad is not None:
                head.grad[0, 0] = float("inf")  # one rank only
            scaler.unscale_(o)
            o.clip_grad_norm(1.0)
            scaler.step(o)
            scaler.update()
        skipped.append(torch.equal(before, flat(sdp.module)))
    return {
        "skipped": skipped,
        "scales": [float(s.get_scale()) for s in scalers],
        "exact": torch.equal(flat(sdp.module), flat(ddp.module)),
    }


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_amp_inf_on_one_rank_skips_on_every_rank(pool, world):
    # the owner of head.weight sees the inf; every other rank must skip too
    results = pool.run(amp_task, 64, 0, **world)
    for r in results:
        assert r["skipped"] == [False, True, False], r
        assert r["scales"][0] == r["scales"][1] == results[0]["scales"][0]
        assert r["exact"]


def clip_task(ctx, bucket):
    sdp, opt, ddp, ref_opt = pair(ctx, bucket)
    norms = []
    for step in range(3):
        for net, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            (net(batch(step, ctx.rank)).pow(2).mean() * 100).backward()
            norms.append(float(o.clip_grad_norm(0.5)))
            o.step()
    return norms, torch.equal(flat(sdp.module), flat(ddp.module))


@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[4]], ids=["ws2", "offset23"])
def test_clip_grad_norm_is_global(pool, world):
    for norms, exact in pool.run(clip_task, 0, **world):
        assert norms[0::2] == norms[1::2] and max(norms) > 0.5 and exact


def host_reads_task(ctx, bucket, branch=None, collective="auto"):
    """Host reads of tensor values in one forward + backward, SDP against DDP; the counter
    must see a deliberate ``.item()`` and ``.tolist()`` (so it cannot be blind)."""
    from sdp_utils import HostReads

    net = {"branch": branch is not None}
    ddp_kw = {"find_unused_parameters": branch is not None}
    sdp, opt, ddp, ref_opt = pair(ctx, bucket, net=net, ddp=ddp_kw, collective=collective)
    counts = {}
    for step in range(3):
        use_branch = branch is not None and (step + ctx.rank * branch) % 2 == 0
        for name, net_, o in (("sdp", sdp, opt), ("ddp", ddp, ref_opt)):
            o.zero_grad(set_to_none=step % 2 == 0)  # both kinds of zero_grad
            with HostReads() as reads:
                net_(batch(step, ctx.rank), use_branch=use_branch).pow(2).mean().backward()
            counts.setdefault(name, []).append(reads.reads)
            o.step()
    with HostReads() as control:
        torch.ones(2).sum().item()
        torch.ones(2).tolist()
    exact = torch.equal(flat(sdp.module), flat(ddp.module))
    grads = [p.grad for p in sdp.module.parameters() if p.grad is not None]
    storages = len({g.untyped_storage().data_ptr() for g in grads})  # owned grads' buckets
    return {"counts": counts, "control": control.reads, "exact": exact, "storages": storages}


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_forward_and_backward_read_no_tensor_value_on_the_host(pool, bucket, collective):
    # DDP without find_unused_parameters reads none; neither may SDP (each is a sync on CUDA)
    for r in pool.run(host_reads_task, bucket, collective=collective, world_size=2):
        assert r["control"] == ["aten._local_scalar_dense", "tolist"], r["control"]
        assert r["counts"]["ddp"] == [[], [], []]
        # one read, once: the second forward agrees on the order backward produced the
        # gradients in (rank 0's, broadcast), as DDP's bucket rebuild does
        assert r["counts"]["sdp"] == [[], ["tolist"], []], r["counts"]["sdp"]
        assert r["exact"]
        if bucket == 2**23:  # one bucket per owner: the owned grads are views of one buffer
            assert r["storages"] == 1


def test_an_owner_without_a_gradient_reads_the_used_flags_once(pool):
    # `never` is used on no rank: its owner lacks a gradient and reads the flags, once per
    # backward (DDP with find_unused_parameters=True reads too)
    results = pool.run(host_reads_task, 64, branch=0, world_size=2)
    for r in results:
        extra = [0, 1, 0]  # the second forward's one-time order agreement (see above)
        for step, reads in enumerate(r["counts"]["sdp"]):
            assert set(reads) <= {"tolist"} and len(reads) <= 1 + extra[step], r["counts"]
        assert r["exact"]
    assert any(reads == ["tolist"] for r in results for reads in r["counts"]["sdp"][::2])


class _Reversed(torch.nn.Module):
    """Registers ``first`` before ``second`` but runs ``second`` first: backward produces
    ``first``'s gradients first, the reverse of what the initial plan assumes."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.second = torch.nn.Linear(8, 4)

    def forward(self, x, use_branch=False):
        return self.first(torch.tanh(self.second(x)))


def launch_order_task(ctx, collective, reversed_model=False, iterations=1):
    """Events of each backward: gradients produced (a hook registered after SDP's) and
    collectives launched (dist.reduce / reduce_scatter_tensor, recorded)."""
    from oss_plus import OSS, ShardedDataParallel
    from oss_plus.data_parallel import buckets as buckets_module

    if reversed_model:
        torch.manual_seed(0)
        model = _Reversed()
        opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
        sdp = ShardedDataParallel(model, opt, ctx.group, reduce_buffer_size=0)
    else:
        sdp, opt, _, _ = pair(ctx, 0, collective=collective)
    events = []
    for i, p in enumerate(sdp.module.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: events.append(("grad", i)))
    real = buckets_module.dist

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def reduce(self, tensor, *args, **kwargs):
            events.append(("send", tensor.numel()))
            return real.reduce(tensor, *args, **kwargs)

        def reduce_scatter_tensor(self, out, tensor, *args, **kwargs):
            events.append(("send", tensor.numel()))
            return real.reduce_scatter_tensor(out, tensor, *args, **kwargs)

    buckets_module.dist = Recording()
    runs = []
    try:
        for step in range(iterations):
            events.clear()
            sdp(batch(step, ctx.rank)).pow(2).mean().backward()
            runs.append(list(events))
    finally:
        buckets_module.dist = real
    return runs[0] if iterations == 1 else runs


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_buckets_are_sent_while_backward_still_produces_gradients(pool, collective):
    for events in pool.run(launch_order_task, collective, world_size=2):
        kinds = [kind for kind, _ in events]
        assert "send" in kinds and kinds.count("grad") == 6, events
        # overlap: the first bucket leaves before the last gradient exists
        assert kinds.index("send") < len(kinds) - 1 - kinds[::-1].index("grad"), events
        if collective == "reduce":  # one bucket per param: sent in its own gradient's hook
            # (SDP's hook runs before the recording one), each before the next gradient
            assert kinds == ["send", "grad"] * 6, events


def test_buckets_follow_the_order_backward_produced_the_gradients_in(pool):
    # first backward: the plan assumes `second` is reached first, so nothing can be sent
    # before its gradients exist; from the second forward on (order agreed from rank 0,
    # the re-plan's hooks now run after the recording ones) each one-param bucket leaves
    # right after its own gradient, with its one "had a gradient" flag
    # (find_unused_parameters=True, the default)
    numel = [12, 3, 32, 4]  # first.weight, first.bias, second.weight, second.bias
    for first, second in pool.run(launch_order_task, "reduce", True, 2, world_size=2):
        assert [kind for kind, _ in first][:2] == ["grad", "grad"], first
        assert [kind for kind, _ in second] == ["grad", "send"] * 4, second
        assert all(numel[i] + 1 == n for (_, i), (_, n) in zip(second[::2], second[1::2])), second


def unused_flags_task(ctx, find_unused, collective="reduce"):
    """`branch` is used on some ranks and steps, `never` on none. With
    find_unused_parameters=True one "had a gradient" flag per param travels in the buckets
    (no collective of its own; `never` then keeps None on its owner); without it no flag
    travels and `never` gets the zero sum, as fairscale gives it. The collectives of each
    backward are counted on torch.distributed itself."""
    sdp, opt, ddp, ref_opt = pair(
        ctx, 64, net={"branch": True}, ddp={"find_unused_parameters": True},
        find_unused_parameters=find_unused, collective=collective,
    )  # fmt: skip
    names = ("reduce", "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather",
             "all_gather_into_tensor", "all_to_all_single", "send", "isend")  # fmt: skip
    real = {name: getattr(dist, name) for name in names}
    calls: list[tuple[str, int]] = []

    def recording(name):
        def collective(tensor, *args, **kwargs):
            calls.append((name, tensor.numel()))
            return real[name](tensor, *args, **kwargs)

        return collective

    trainable = [p for p in sdp.module.parameters() if p.requires_grad]
    never, exact, per_backward = [], True, []
    for step in range(3):
        use_branch = (step + ctx.rank) % 2 == 0
        for net, o in ((sdp, opt), (ddp, ref_opt)):
            o.zero_grad()
            loss = net(batch(step, ctx.rank), use_branch=use_branch).pow(2).mean()
            if net is sdp:
                calls.clear()
                for name in names:
                    setattr(dist, name, recording(name))
                try:
                    loss.backward()
                finally:
                    for name in names:
                        setattr(dist, name, real[name])
                per_backward.append(list(calls))
            else:
                loss.backward()
        for (name, p), q in zip(sdp.module.named_parameters(), ddp.module.parameters()):
            if opt.param_to_rank[p] != ctx.rank:
                exact &= p.grad is None
            elif name.startswith("never."):
                never.append(None if p.grad is None else float(p.grad.abs().sum()))
            else:
                exact &= q.grad is not None and torch.equal(p.grad, q.grad)
        opt.step()
        ref_opt.step()
    return {"calls": per_backward, "never": never, "exact": exact,
            "numel": sum(p.numel() for p in trainable), "count": len(trainable),
            "params": torch.equal(flat(sdp.module), flat(ddp.module))}  # fmt: skip


@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("find_unused", [True, False])
def test_find_unused_parameters_false_sends_no_flags(pool, find_unused, collective):
    results = pool.run(unused_flags_task, find_unused, collective, world_size=2)
    for r in results:
        assert r["exact"] and r["params"]
        for calls in r["calls"]:  # only the buckets' reductions, with their members' flags
            if collective == "reduce":
                assert {name for name, _ in calls} == {"reduce"}, calls
                flags = r["count"] if find_unused else 0
                assert sum(n for _, n in calls) == r["numel"] + flags, calls
            else:  # segments are padded to the group's largest bucket: no exact count
                assert {name for name, _ in calls} == {"reduce_scatter_tensor"}, calls
    never = [v for r in results for v in r["never"]]
    assert never, "some rank owns a param of `never`"
    assert never == ([None] * len(never) if find_unused else [0.0] * len(never))
