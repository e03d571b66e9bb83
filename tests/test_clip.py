"""OSS.clip_grad_norm: exact sharded norms, one reduction over the right group, fresh params."""

import math

import pytest
import torch
import torch.distributed as dist
from helpers import (
    WORLD_IDS,
    WORLDS,
    backward,
    batch,
    catch,
    clone_model,
    flat_params,
    make_model,
)

from oss_plus import OSS
from oss_plus.amp.clip import BAD_MAX_NORM, BAD_NORM_TYPE, NONFINITE, local_partial, result_device

INF = math.inf
NORM_TYPES = [1.0, 2.0, 3.0, 0.5, INF]


def exact_norm(grads, p):
    """The float64 norm of the concatenated gradients."""
    flat = torch.cat([g.detach().double().reshape(-1) for g in grads])
    return torch.linalg.vector_norm(flat, p).item()


def owned_mask(opt):
    return [opt.param_to_rank[p] == opt.rank for p in opt.flat_params()]


def grads_of(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------ pure: where the total lands
def test_the_total_lands_on_the_first_gradients_device_like_torchs():
    """torch.nn.utils.clip_grad_norm_ returns on the first gradient's device; a rank that
    holds no gradient (ZeRO-2) falls back to the params' device, the same on every rank.
    Checked with tensors of the meta device, which no collective device can be."""
    meta = torch.device("meta")
    frozen = torch.nn.Parameter(torch.zeros(2))  # on the CPU, no gradient
    moved = torch.nn.Parameter(torch.zeros(3, device=meta))
    moved.grad = torch.zeros(3, device=meta)
    assert result_device([frozen, moved]) == meta
    assert result_device([moved.detach().requires_grad_(), frozen]) == meta
    assert result_device([frozen]) == torch.device("cpu")
    assert result_device([]) == torch.device("cpu")


# ------------------------------------------------------------------ pure: the local partial
def test_local_partial_is_the_sum_of_pth_powers_or_the_max():
    torch.manual_seed(0)
    grads = [torch.randn(7, 3), torch.randn(11), torch.randn(2, 2, dtype=torch.float64)]
    cpu = torch.device("cpu")
    for p in (1.0, 2.0, 3.0, 0.5):
        expected = sum(g.double().abs().pow(p).sum() for g in grads)
        got = local_partial(grads, p, cpu)
        assert got.dtype == torch.float64
        assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert local_partial(grads, INF, cpu).item() == max(g.abs().max().item() for g in grads)
    assert local_partial([], 2.0, cpu).item() == 0.0  # an empty shard contributes 0
    assert local_partial([], INF, cpu).item() == 0.0


def test_local_partial_propagates_nan_and_inf():
    cpu = torch.device("cpu")
    nan = [torch.ones(3), torch.tensor([1.0, math.nan])]
    inf = [torch.ones(3), torch.tensor([1.0, math.inf])]
    for p in (1.0, 2.0, INF):
        assert math.isnan(local_partial(nan, p, cpu).item())
        assert local_partial(inf, p, cpu).item() == INF
    # NaN must win even when it is not the last tensor (a max that compares would drop it)
    assert math.isnan(local_partial(list(reversed(nan)), INF, cpu).item())


def test_local_partial_keeps_float32_precision_on_bf16_and_fp16():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        grads = [(torch.randn(n) * 3).to(dtype) for n in (1000, 517, 33, 4096)]
        exact = exact_norm(grads, 2.0)
        ours = local_partial(grads, 2.0, torch.device("cpu")).sqrt().item()
        torch_norm = torch.nn.utils.get_total_norm(grads, 2.0).item()
        assert abs(ours - exact) / exact < 1e-6
        assert abs(torch_norm - exact) > abs(ours - exact)  # torch rounds to the grad dtype


def test_bad_norm_type_and_max_norm_are_rejected_before_any_collective():
    for bad in (0, -1.0, math.nan, "two"):
        with pytest.raises(ValueError) as info:
            local_partial([torch.ones(1)], bad, torch.device("cpu"))
        assert str(info.value) == BAD_NORM_TYPE.format(norm_type=bad)


def bad_args_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    backward(model, 0)
    return catch(opt.clip_grad_norm, 1.0, norm_type=-2), catch(opt.clip_grad_norm, -1.0)


def test_bad_arguments_raise_value_error_on_every_rank(pool):
    for norm, max_norm in pool.run(bad_args_task, world_size=2, timeout=30):
        assert norm == ("ValueError", BAD_NORM_TYPE.format(norm_type=-2))
        assert max_norm == ("ValueError", BAD_MAX_NORM.format(max_norm=-1.0))


# ------------------------------------------------------------------ parity with torch
def parity_task(ctx, max_norm):
    """Same batch on every rank (= DDP-averaged grads); clip, step, compare with torch."""
    out = []
    for p in NORM_TYPES:
        model = make_model()
        ref_model = clone_model(model)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
        ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
        totals, ref_totals, clipped_ok, untouched_ok = [], [], True, True
        for step in range(3):
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                backward(m, step)
            before = grads_of(model)
            totals.append(opt.clip_grad_norm(max_norm, norm_type=p))
            ref_totals.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm, p))
            for own, g, g0, r in zip(owned_mask(opt), grads_of(model), before, grads_of(ref_model)):
                if own:
                    clipped_ok &= torch.equal(g, r)
                else:
                    untouched_ok &= torch.equal(g, g0)  # only owned grads are scaled
            opt.step()
            ref.step()
        diff = (flat_params(model) - flat_params(ref_model)).abs().max().item()
        out.append(
            {
                "p": p,
                "totals": torch.stack(totals),
                "ref": torch.stack(ref_totals),
                "clipped_ok": clipped_ok,
                "untouched_ok": untouched_ok,
                "param_diff": diff,
                "params": flat_params(model),
            }
        )
    return out


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_norm_and_clipped_update_equal_torch_clip_grad_norm(pool, world):
    results = pool.run(parity_task, 0.05, **world)
    for rank_result in results:
        for r, r0 in zip(rank_result, results[0]):
            assert r["totals"].dtype == torch.float32
            assert torch.equal(r["totals"], r0["totals"]), "the total differs between ranks"
            assert torch.equal(r["totals"], r["ref"]), r["p"]  # bit-identical to torch
            assert (r["ref"] > 0.05).all()  # the clipping really clipped
            assert r["clipped_ok"] and r["untouched_ok"], r["p"]
            assert r["param_diff"] == 0, (r["p"], r["param_diff"])
            assert torch.equal(r["params"], r0["params"]), "replicas differ"


def no_clip_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref_model, ref)):
        o.zero_grad()
        backward(m, 0)
    before = grads_of(model)
    total = opt.clip_grad_norm(1e6)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, grads_of(model)))
    opt.step()
    ref.step()
    exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    return total, unchanged, exact


def test_below_max_norm_grads_are_untouched_and_the_step_is_bit_exact(pool):
    for total, unchanged, exact in pool.run(no_clip_task, world_size=3):
        assert 0 < total.item() < 1e6
        assert unchanged and exact


def ddp_task(ctx):
    """Different batches per rank, DDP averages: OSS + clip vs DDP + SGD + torch clip."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), process_group=ctx.group)
    ref_model = DDP(make_model(), process_group=ctx.group)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    totals, ref_totals = [], []
    for step in range(3):
        x = batch(10 * step + ctx.rank)
        for m, o, t, clip in (
            (model, opt, totals, opt.clip_grad_norm),
            (ref_model, ref, ref_totals, None),
        ):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            if clip is None:
                t.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
            else:
                t.append(clip(0.05))
            o.step()
    diff = (flat_params(model.module) - flat_params(ref_model.module)).abs().max().item()
    return torch.stack(totals), torch.stack(ref_totals), diff, flat_params(model.module)


@pytest.mark.parametrize("world", WORLDS[1:], ids=WORLD_IDS[1:])
def test_equals_torch_clip_on_ddp_averaged_grads(pool, world):
    results = pool.run(ddp_task, **world)
    for totals, ref, diff, params in results:
        assert torch.equal(totals, ref)  # bit-identical to torch in fp32
        assert (ref > 0.05).all()
        assert diff == 0
        assert torch.equal(params, results[0][3])


# ------------------------------------------------------------------ precision on bf16/fp16
def low_precision_task(ctx, dtype):
    model = make_model(width=64, depth=3).to(dtype)
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    x = (batch(0, width=64, n=32) * 40).to(dtype)
    for m in (model, ref_model):
        m(x).float().pow(2).mean().backward()
    exact = exact_norm([p.grad for p in model.parameters()], 2.0)
    ours = opt.clip_grad_norm(1e9).item()
    theirs = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9).item()
    return exact, ours, theirs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_norm_within_float32_rounding_of_the_float64_norm(pool, dtype):
    for exact, ours, theirs in pool.run(low_precision_task, dtype, world_size=2):
        assert abs(ours - exact) / exact < 1e-5  # the issue asks for 0.1%
        assert abs(theirs - exact) > abs(ours - exact)  # torch's rounds to the grad dtype


# ------------------------------------------------------------------ groups
def two_groups_task(ctx):
    """Ranks (0,1) and (2,3) each run their own OSS; fairscale reduced over WORLD."""
    mine = ctx.groups[(0, 1)] if ctx.global_rank < 2 else ctx.groups[(2, 3)]
    world = ctx.groups[(0, 1, 2, 3)]
    seed = ctx.global_rank // 2
    model = make_model(seed=seed)
    opt = OSS(model.parameters(), group=mine, lr=0.1)
    model(batch(seed)).pow(2).mean().backward()
    full = exact_norm([p.grad for p in model.parameters()], 2.0)
    own = opt.clip_grad_norm(1e9).item()
    over_world = opt.clip_grad_norm(1e9, group=world).item()  # what fairscale computes
    return full, own, over_world


def test_two_independent_groups_each_get_their_own_norm(pool):
    r = pool.run(two_groups_task, ranks=(0, 1, 2, 3))
    (full_a, _, world_a), (full_b, _, _) = r[0], r[2]
    assert full_a != pytest.approx(full_b)  # the two groups really differ
    for full, own, _ in r:
        assert own == pytest.approx(full, rel=1e-6)
    assert world_a == pytest.approx(math.hypot(full_a, full_b), rel=1e-6)
    assert all(w == world_a for _, _, w in r)


def same_model_two_groups_task(ctx):
    mine = ctx.groups[(0, 1)] if ctx.global_rank < 2 else ctx.groups[(2, 3)]
    model = make_model()
    opt = OSS(model.parameters(), group=mine, lr=0.1)
    backward(model, 0)
    return opt.clip_grad_norm(1e9).item(), opt.clip_grad_norm(1e9, group=dist.group.WORLD).item()


def test_reducing_over_world_would_be_sqrt2_too_large(pool):
    """FINDINGS fairscale #2: with two groups of 2 ranks, WORLD gives sqrt(2) x the norm."""
    for own, world in pool.run(same_model_two_groups_task, ranks=(0, 1, 2, 3)):
        assert world == pytest.approx(math.sqrt(2) * own, rel=1e-6)


def filter_task(ctx):
    """filter_params_fn narrows what is counted; every owned grad is still scaled."""
    model = make_model()
    ref_model = clone_model(model)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    for m in (model, ref_model):
        backward(m, 0)
    seen = []

    def weights_only(params):
        seen.append(len(params))
        return [p for p in params if names[id(p)].endswith("weight")]

    total = opt.clip_grad_norm(0.01, filter_params_fn=weights_only)
    ref_weights = [p for n, p in ref_model.named_parameters() if n.endswith("weight")]
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref_weights])
    coef = 0.01 / (expected + 1e-6)
    scaled = all(
        torch.allclose(p.grad, q.grad * coef, rtol=1e-6)
        for p, q, own in zip(model.parameters(), ref_model.parameters(), owned_mask(opt))
        if own
    )
    return total, expected, scaled, seen[0], sum(owned_mask(opt))


def test_filter_params_fn_receives_the_owned_params_and_filters_the_count(pool):
    for total, expected, scaled, seen, owned in pool.run(filter_task, world_size=3):
        assert total.item() == pytest.approx(expected.item(), rel=1e-6)
        assert scaled
        assert seen == owned


# ------------------------------------------------------------------ never a stale param list
def stale_task(ctx):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (50, 40, 30, 20, 10, 5)]
    extra = torch.nn.Parameter(torch.randn(25))
    opt = OSS(params, group=ctx.group, lr=0.1)

    def grads(ps, k=1.0):
        for i, p in enumerate(ps):
            p.grad = None if not p.requires_grad else torch.full_like(p, k * (i + 1))

    def expected(ps):
        return exact_norm([p.grad for p in ps if p.grad is not None], 2.0)

    out = {"no_grads": opt.clip_grad_norm(1.0).item()}  # fairscale caches its list here
    grads(params)
    out["first"] = (opt.clip_grad_norm(1e9).item(), expected(params))
    for p in params[:2]:
        p.requires_grad_(False)
    grads(params)
    out["frozen"] = (opt.clip_grad_norm(1e9).item(), expected(params))
    opt.refresh_trainable()
    grads(params)
    out["refreshed"] = (opt.clip_grad_norm(1e9).item(), expected(params))
    for p in params[:2]:
        p.requires_grad_(True)
    grads(params)
    out["unfrozen"] = (opt.clip_grad_norm(1e9).item(), expected(params))
    opt.add_param_group({"params": [extra]})
    grads(params + [extra])
    out["added"] = (opt.clip_grad_norm(1e9).item(), expected(params + [extra]))
    params[3].grad = None
    out["grad_none"] = (opt.clip_grad_norm(1e9).item(), expected(params + [extra]))
    return out


def test_the_owned_params_are_computed_fresh_at_every_call(pool):
    """FINDINGS fairscale #2: no stale list (before grads, freezing, refresh, add_param_group)."""
    for out in pool.run(stale_task, world_size=2):
        assert out.pop("no_grads") == 0.0
        for case, (got, exp) in out.items():
            assert got == pytest.approx(exp, rel=1e-6), case


def unfreeze_then_step_task(ctx):
    """Clip right after unfreezing: the grads that get scaled are those the new owners step."""
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for m in (model, ref_model):
        list(m.parameters())[0].requires_grad_(False)
    for step in range(4):
        if step == 2:
            for m in (model, ref_model):
                list(m.parameters())[0].requires_grad_(True)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward(m, step)
        opt.clip_grad_norm(0.05)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        opt.step()
        ref.step()
    return (flat_params(model) - flat_params(ref_model)).abs().max().item(), flat_params(model)


def test_clip_after_unfreezing_scales_the_grads_the_new_owners_step(pool):
    results = pool.run(unfreeze_then_step_task, world_size=2)
    for diff, params in results:
        assert diff < 1e-6
        assert torch.equal(params, results[0][1])


def empty_shard_task(ctx):
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(4))
    opt = OSS([a, b], group=ctx.group, lr=0.1)
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), -1.0)
    owned = len(opt.optim.param_groups[0]["params"])
    return owned, [opt.clip_grad_norm(1e9, norm_type=p).item() for p in (1.0, 2.0, INF)]


def test_ranks_that_own_nothing_contribute_zero_and_still_reduce(pool):
    results = pool.run(empty_shard_task, world_size=4)
    assert [owned for owned, _ in results] == [1, 1, 0, 0]
    for _, totals in results:
        assert totals == pytest.approx([10.0, math.sqrt(16.0), 2.0])


# ------------------------------------------------------------------ non-finite norms
def nonfinite_task(ctx, value):
    """A NaN/inf in one grad that rank 1 owns, on rank 1 only."""
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    first_owned = next(q for q in model.parameters() if opt.param_to_rank[q] == 1)

    def grads():
        opt.zero_grad()
        backward(model, 0)
        if ctx.rank == 1:
            first_owned.grad.view(-1)[0] = value

    out = {}
    for p in (1.0, 2.0, INF):
        grads()
        out[p] = opt.clip_grad_norm(1.0, norm_type=p).item()
        grads()
        out[f"error-{p}"] = catch(opt.clip_grad_norm, 1.0, norm_type=p, error_if_nonfinite=True)
    return out


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_nonfinite_norms_propagate_and_error_if_nonfinite_raises_on_every_rank(pool, value):
    for out in pool.run(nonfinite_task, value, world_size=3, timeout=30):
        for p in (1.0, 2.0, INF):
            total = out[p]
            assert math.isnan(total) if math.isnan(value) else total == INF, (p, total)
            kind, message = out[f"error-{p}"]
            assert kind == "RuntimeError"
            assert message == NONFINITE.format(norm_type=p, total=total)


def no_host_sync_task(ctx):
    """Clipping must not read a tensor on the host: make every such read fail."""
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    backward(model, 0)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync in clip_grad_norm")

    names = ("item", "tolist", "__bool__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in saved:
            setattr(torch.Tensor, name, forbidden)
        totals = [opt.clip_grad_norm(0.01, norm_type=p) for p in (2.0, INF)]
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return [t.item() for t in totals]


def test_clipping_never_reads_a_tensor_on_the_host(pool):
    for l2, linf in pool.run(no_host_sync_task, world_size=2):
        assert l2 > 0.01  # it clipped ...
        assert 0 < linf <= 0.01 * (1 + 1e-5)  # ... so the max entry is now below max_norm


# ------------------------------------------------------------------ the partial-sum path
#: The ways into the float64 partial-sum path: ``group=`` another group over the same ranks
#: (WORLD), an identity ``filter_params_fn``, and the fairscale adapter (which reduces over
#: WORLD, so always takes it).
PARTIAL_PATHS = ["group", "filter", "fairscale"]
GRAD_CASES = {"finite": None, "nan": math.nan, "inf": math.inf}


def partial_path_task(ctx, path, norm_type, poison, error_if_nonfinite):
    """Clip on the partial-sum path with a NaN/inf (or nothing) in one grad of rank 1's
    shard; the same through torch.nn.utils.clip_grad_norm_ on an unsharded copy."""
    model = make_model()
    ref_model = clone_model(model)
    if path == "fairscale":
        from oss_plus.compat.fairscale import OSS as FairscaleOSS

        opt = FairscaleOSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    else:
        opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    kwargs = {"error_if_nonfinite": True} if error_if_nonfinite else {}
    if path == "group":
        kwargs["group"] = dist.group.WORLD
    elif path == "filter":
        kwargs["filter_params_fn"] = list
    for m in (model, ref_model):
        backward(m, 0)
    target = next(i for i, q in enumerate(model.parameters()) if opt.param_to_rank[q] == 1)
    if poison is not None:
        list(ref_model.parameters())[target].grad.view(-1)[0] = poison
        if ctx.rank == 1:  # only the owner holds it (the others never count this grad)
            list(model.parameters())[target].grad.view(-1)[0] = poison
    ours = catch(opt.clip_grad_norm, 0.05, norm_type, **kwargs)
    ref = catch(
        torch.nn.utils.clip_grad_norm_,
        ref_model.parameters(),
        0.05,
        norm_type,
        error_if_nonfinite=error_if_nonfinite,
    )
    pairs = [
        (p.grad, q.grad)
        for p, q, own in zip(model.parameters(), ref_model.parameters(), owned_mask(opt))
        if own
    ]
    same_grads = all(torch.allclose(g, r, rtol=1e-5, atol=0, equal_nan=True) for g, r in pairs)
    return ours, ref, same_grads


def _same_total(ours, ref):
    ours, ref = float(ours), float(ref)
    if math.isnan(ref):
        return math.isnan(ours)
    return ours == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
@pytest.mark.parametrize("grads", sorted(GRAD_CASES))
@pytest.mark.parametrize("path", PARTIAL_PATHS)
def test_partial_sum_path_equals_torch_clip_grad_norm(pool, path, grads, norm_type):
    """Norm, clipped grads and NaN/inf propagation equal torch's on the unsharded model."""
    for ours, ref, same_grads in pool.run(
        partial_path_task, path, norm_type, GRAD_CASES[grads], False, world_size=4
    ):
        assert ours[0] == ref[0] == "ok"
        assert _same_total(ours[1], ref[1]), (ours, ref)
        if grads == "finite":
            assert ref[1] > 0.05  # it really clipped
        assert same_grads, "the owned grads are not scaled like torch's"


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
@pytest.mark.parametrize("grads", ["nan", "inf"])
@pytest.mark.parametrize("path", ["group", "filter"])
def test_partial_sum_path_error_if_nonfinite_raises_on_every_rank(pool, path, grads, norm_type):
    """torch raises RuntimeError before scaling anything; so does every rank here, though
    only rank 1 holds the non-finite grad."""
    results = pool.run(partial_path_task, path, norm_type, GRAD_CASES[grads], True, world_size=4)
    for ours, ref, same_grads in results:
        assert ref[0] == "RuntimeError"
        total = math.nan if grads == "nan" else INF
        assert ours == ("RuntimeError", NONFINITE.format(norm_type=norm_type, total=total))
        assert same_grads  # nothing was scaled, as in torch
