"""ShardedGradScaler: every rank skips the same steps and keeps the same scale (no hang)."""

import pytest
import torch
from helpers import (
    WORLD_IDS,
    WORLDS,
    batch,
    catch,
    clone_model,
    flat_params,
    make_model,
    params_equal,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from oss_plus import OSS, ShardedGradScaler
from oss_plus.amp.scaler import SCALES_WOULD_DIFFER
from oss_plus.runtime.dist import peer_failed

INF_STEPS = (1, 3)


def scaled_backward(model, scaler, x):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    return loss


def poison(ctx, model, opt, step):
    """On the last rank only, at INF_STEPS: an inf in a grad it does not own, then one it owns."""
    if ctx.rank != ctx.world_size - 1 or step not in INF_STEPS:
        return
    params = list(model.parameters())
    mine = params
    if isinstance(opt, OSS):
        mine = [p for p in params if opt.param_to_rank[p] == ctx.rank]
    others = [p for p in params if all(p is not q for q in mine)] or mine
    target = others[0] if step == INF_STEPS[0] else mine[0]
    target.grad.view(-1)[0] = float("inf")


def one_rank_inf_task(ctx, steps=5):
    """fairscale #9: no DDP averaging (each rank its own batch), an inf on one rank only."""
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    skipped, scales, norms = [], [], []
    for step in range(steps):
        opt.zero_grad()
        scaled_backward(model, scaler, batch(10 * step + ctx.rank))
        poison(ctx, model, opt, step)
        before = flat_params(model)
        scaler.unscale_(opt)
        norms.append(opt.clip_grad_norm(1.0))
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, flat_params(model)))
        scales.append(scaler.get_scale())
    return skipped, scales, flat_params(model), torch.stack(norms)


@pytest.mark.parametrize("world", WORLDS[1:], ids=WORLD_IDS[1:])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(pool, world):
    results = pool.run(one_rank_inf_task, timeout=30, **world)
    for skipped, scales, params, norms in results:
        assert [s for s, skip in enumerate(skipped) if skip] == list(INF_STEPS)
        assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**6, 2.0**6]  # backoff twice, same everywhere
        assert torch.equal(params, results[0][2]), "replicas diverged"
        assert torch.equal(norms, results[0][3])
        assert torch.isfinite(norms[[0, 2, 4]]).all()


def plain_scaler_task(ctx):
    """The same scenario with torch.amp.GradScaler: ranks disagree (step() is not called: the
    rank that skips would leave the others waiting in the broadcast)."""
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaled_backward(model, scaler, batch(10 + ctx.rank))
    poison(ctx, model, opt, INF_STEPS[0])
    scaler.unscale_(opt)
    return sum(v.item() for v in scaler._found_inf_per_device(opt).values())


def test_the_plain_grad_scaler_disagrees_between_ranks(pool):
    found = pool.run(plain_scaler_task, world_size=2, timeout=30)
    assert found == [0.0, 1.0]  # rank 0 would step and broadcast, rank 1 would skip: a hang


def plain_scaler_step_task(ctx, unscale):
    """That scenario through scaler.step() with the contract declared (ZeRO-1 without
    averaging: ``handle_loss_scaling()``): OSS.step gets the scaler's flag (torch's
    _step_supports_amp_scaling contract) and the ranks compare theirs."""
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    opt.handle_loss_scaling()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaled_backward(model, scaler, batch(10 + ctx.rank))
    poison(ctx, model, opt, INF_STEPS[0])
    before = flat_params(model)

    def step():
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)

    outcome = catch(step)
    left = [name for name in ("grad_scale", "found_inf") if hasattr(opt, name)]
    return outcome, torch.equal(before, flat_params(model)), left


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale-step"])
def test_a_plain_grad_scaler_that_would_diverge_is_refused_on_every_rank(pool, unscale):
    """Before torch's contract: a hang. Now every rank raises, nothing stepped, and the
    optimizer keeps no stale grad_scale (the next GradScaler.step would multiply it)."""
    for (kind, message), untouched, left in pool.run(
        plain_scaler_step_task, unscale, world_size=2, timeout=30
    ):
        assert kind == "RuntimeError"
        assert message == SCALES_WOULD_DIFFER.format(blind="global rank(s) [0]")
        assert untouched and not left


def plain_fp16_task(ctx):
    """fp16 grads on one rank under a plain GradScaler.step(): OSS.step refuses to unscale
    them as GradScaler.unscale_ does, on every rank."""
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    opt.handle_loss_scaling()
    if ctx.rank == 1:
        for p in model.parameters():
            p.data = p.data.half()
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(batch(0).to(next(model.parameters()).dtype)).float().sum()
    scaler.scale(loss).backward()
    return catch(scaler.step, opt)


def test_fp16_gradients_under_a_plain_scaler_raise_on_every_rank(pool):
    theirs, mine = pool.run(plain_fp16_task, world_size=2, timeout=30)
    assert mine == ("ValueError", "Attempting to unscale FP16 gradients.")
    assert theirs[0] == "ValueError" and peer_failed([0, 1], [1], 0) in theirs[1]


def parity_task(ctx, clip, steps=6, plain=False):
    """Same batch everywhere: OSS + ShardedGradScaler (``plain``: torch.amp.GradScaler, which
    steps OSS by its classic path under ZeRO-1) == plain Adam + torch.amp.GradScaler."""
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    kind = torch.amp.GradScaler if plain else ShardedGradScaler
    scaler = kind("cpu", init_scale=2.0**20, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
    scales, norms = [], []
    for step in range(steps):
        for m, o, s in ((model, opt, scaler), (ref_model, ref, ref_scaler)):
            o.zero_grad()
            scaled_backward(m, s, batch(step) * 30)
            if clip:
                s.unscale_(o)
                norms.append(
                    o.clip_grad_norm(0.2)
                    if o is opt
                    else torch.nn.utils.clip_grad_norm_(m.parameters(), 0.2)
                )
            s.step(o)
            s.update()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    diff = (flat_params(model) - flat_params(ref_model)).abs().max().item()
    exact = torch.equal(flat_params(model), flat_params(ref_model))
    return scales, exact, diff, norms


@pytest.mark.parametrize("plain", [False, True], ids=["sharded", "plain"])
@pytest.mark.parametrize("world", [WORLDS[1], WORLDS[3], WORLDS[4]], ids=["ws2", "ws4", "offset23"])
def test_same_steps_and_scales_as_torch_grad_scaler(pool, world, plain):
    for scales, exact, _, _ in pool.run(parity_task, False, plain=plain, **world):
        assert all(a == b for a, b in scales)
        assert len({a for a, _ in scales}) > 1  # the scale moved (overflow backoff / growth)
        assert exact


@pytest.mark.parametrize("plain", [False, True], ids=["sharded", "plain"])
def test_clip_grad_norm_between_unscale_and_step(pool, plain):
    for scales, _, diff, norms in pool.run(parity_task, True, plain=plain, world_size=3):
        assert all(a == b for a, b in scales)
        finite = [(a, b) for a, b in zip(norms[::2], norms[1::2]) if torch.isfinite(b)]
        assert finite and all(torch.allclose(a, b, rtol=1e-6) for a, b in finite)
        assert all(b > 0.2 for _, b in finite)  # it clipped
        assert diff < 1e-5


# ------------------------------------------------------------------ other optimizers and groups
def plain_optimizer_task(ctx):
    """Only rank 0 trains: with a plain optimizer the scaler makes no collective call."""
    if ctx.rank != 0:
        return None
    out = []
    for cls in (ShardedGradScaler, torch.amp.GradScaler):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=2.0**8)
        for step in range(3):
            opt.zero_grad()
            scaled_backward(model, scaler, batch(step))
            if step == 1:
                next(model.parameters()).grad.view(-1)[0] = float("nan")
            scaler.step(opt)
            scaler.update()
        out.append((scaler.get_scale(), flat_params(model)))
    return out


def test_with_a_plain_optimizer_it_is_torch_grad_scaler(pool):
    results = pool.run(plain_optimizer_task, world_size=2, timeout=30)
    (ours, ours_params), (torch_scale, torch_params) = results[0]
    assert ours == torch_scale == 2.0**7
    assert torch.equal(ours_params, torch_params)
    assert isinstance(ShardedGradScaler("cpu"), torch.amp.GradScaler)


def explicit_group_task(ctx, kind):
    """group= makes plain optimizers agree too; ZeroRedundancyOptimizer uses its process group."""
    model = make_model()
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=ctx.group, lr=0.1
        )
        scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**8, group=ctx.group)
    skipped = []
    for step in range(3):
        opt.zero_grad()
        scaled_backward(model, scaler, batch(step))
        if step == 1 and ctx.rank == 0:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = flat_params(model)
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, flat_params(model)))
    return skipped, scaler.get_scale(), flat_params(model)


@pytest.mark.parametrize("kind", ["plain_with_group", "zero"])
def test_explicit_group_and_zero_redundancy_optimizer(pool, kind):
    results = pool.run(explicit_group_task, kind, ranks=(2, 3), timeout=30)
    for skipped, scale, params in results:
        assert skipped == [False, True, False]
        assert scale == 2.0**7
        assert torch.equal(params, results[0][2])


def no_grads_task(ctx):
    """A rank without any gradient (e.g. it got no batch) still joins and agrees; the next,
    clean step is the plain optimizer's."""
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    opt.zero_grad()
    loss = scaled_backward(model, scaler, batch(0)) if ctx.rank == 0 else None
    if ctx.rank == 0:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    elif loss is None:
        scaler.scale(torch.ones(()))  # initializes the scale like a forward would
    before = flat_params(model)
    scaler.step(opt)
    scaler.update()
    skipped, scale = torch.equal(before, flat_params(model)), scaler.get_scale()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7)
    for m, o, s in ((model, opt, scaler), (ref_model, ref, ref_scaler)):
        o.zero_grad()
        scaled_backward(m, s, batch(1))
        s.step(o)
        s.update()
    return skipped, scale, params_equal(model, ref_model)


def test_a_rank_without_gradients_joins_the_reduction(pool):
    for skipped, scale, exact in pool.run(no_grads_task, world_size=2, timeout=30):
        assert skipped and scale == 2.0**7
        assert exact, "the step after the skipped one differs from plain SGD"


def peer_error_task(ctx):
    """fp16 grads on one rank make GradScaler raise there: every rank must raise."""
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    if ctx.rank == 1:
        for p in model.parameters():
            p.data = p.data.half()
    scaler = ShardedGradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(batch(0).to(next(model.parameters()).dtype)).float().sum()
    scaler.scale(loss).backward()
    return catch(scaler.unscale_, opt)


def test_an_unscale_error_on_one_rank_raises_on_every_rank(pool):
    theirs, mine = pool.run(peer_error_task, world_size=2, timeout=30)
    assert mine == ("ValueError", "Attempting to unscale FP16 gradients.")
    assert theirs[0] == "ValueError"  # the failed rank's type, its rank and message
    expected = peer_failed([0, 1], [1], 0) + "; global rank 1 raised ValueError: " + mine[1]
    assert theirs[1] == expected


# ------------------------------------------------------------------ the demo's --amp path
def demo_amp_task(ctx):
    """The demo's AMP rows, and how far its unsharded reference moved from the initial model
    (what a sharded run that did nothing would differ by)."""
    from oss_plus import demo

    made, real = [], demo.DDP

    def recording_ddp(module, **kwargs):
        made.append((module, flat_params(module)))
        return real(module, **kwargs)

    demo.DDP = recording_ddp
    try:
        log = demo.amp_rank_main(ctx.rank, ctx.world_size, 12, 16, 2, group=ctx.group)
    finally:
        demo.DDP = real
    plain, initial = made[1]
    log["ref_moved"] = (flat_params(plain) - initial).abs().max().item()
    return log


def test_demo_amp_path_runs_the_recipe(pool):
    from oss_plus.cli import build_parser
    from oss_plus.demo import format_amp_report

    results = pool.run(demo_amp_task, world_size=2, timeout=60)
    for r in results:
        assert [row[2] for row in r["rows"]] == [row[2] for row in r["ref_rows"]]
        assert [row[2] for row in r["rows"]] == [row[2] for row in results[0]["rows"]]
        assert r["scale"] == r["ref_scale"] == results[0]["scale"]
        assert r["wire"] * 2 == r["wire_fp32"]
        # bf16 wire rounding, nothing worse: far closer to the unsharded run than the
        # initial model (where a step that did nothing would stay) is
        assert 0 < r["param_diff"] < r["ref_moved"] / 2
    report = format_amp_report(results, 12)
    assert "identical on every rank: yes" in report and "(50%)" in report
    args = build_parser().parse_args(["demo", "--amp", "--steps", "3"])
    assert args.amp and args.func.__module__ == "oss_plus.demo"


# ------------------------------------------------------------------ the recipe in docs/amp.md
class PlainAdamW(torch.optim.AdamW):
    """The recipe's reference: OSS's constructor and clip_grad_norm over an unsharded AdamW."""

    def __init__(self, params, optim=None, group=None, broadcast_dtype=None, **kwargs):
        super().__init__(params, **kwargs)

    def clip_grad_norm(self, max_norm):
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


class StillAdamW(PlainAdamW):
    """:class:`PlainAdamW` whose step does nothing (what the recipe must differ from)."""

    def step(self, closure=None):
        return None


def docs_recipe_task(ctx, path, optimizer=None):
    """Run the recipe of docs/amp.md; with ``optimizer``, ``oss_plus.OSS`` is that class."""
    import oss_plus

    with open(path) as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {"__name__": "docs_amp_recipe"}
    real = oss_plus.OSS
    oss_plus.OSS = optimizer or real
    try:
        exec(compile(code, path, "exec"), namespace)
        return namespace["train"](steps=4, group=ctx.group)
    finally:
        oss_plus.OSS = real


def test_the_recipe_in_docs_amp_md_runs(pool):
    from pathlib import Path

    path = str(Path(__file__).resolve().parent.parent / "docs" / "amp.md")
    results = pool.run(docs_recipe_task, path, world_size=2, timeout=60)
    ref = pool.run(docs_recipe_task, path, PlainAdamW, world_size=2, timeout=60)
    still = pool.run(docs_recipe_task, path, StillAdamW, world_size=2, timeout=60)
    (loss, norm, scale), (loss1, norm1, scale1) = results
    assert norm == norm1 and scale == scale1  # the same norm and scale on every rank
    assert loss > 0 and loss != loss1  # each rank had its own batch
    for (loss, norm, scale), (ref_loss, ref_norm, ref_scale), (still_loss, _, _) in zip(
        results, ref, still
    ):
        assert scale == ref_scale
        # the unsharded AdamW's loss and norm, up to the bf16 wire: much closer to them than
        # a run whose optimizer did nothing
        assert abs(loss - ref_loss) < abs(still_loss - ref_loss) / 4
        assert norm == pytest.approx(ref_norm, rel=1e-2)


def agreements_task(ctx, plain):
    """How many found-inf agreements one scaled step of OSS makes (each is an all_gather and
    a host read): ShardedGradScaler's own only, a plain GradScaler's in OSS.step only."""
    from oss_plus.runtime import dist as _dist

    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    opt.handle_loss_scaling()  # what ShardedDataParallel declares; ShardedGradScaler ignores it
    scaler = (torch.amp.GradScaler if plain else ShardedGradScaler)("cpu", init_scale=2.0**8)
    scaled_backward(model, scaler, batch(3))
    calls, agree = [], _dist.agree

    def counted(*args, **kwargs):
        calls.append(1)
        return agree(*args, **kwargs)

    _dist.agree = counted
    try:
        scaler.step(opt)
    finally:
        _dist.agree = agree
    scaler.update()
    return len(calls)


@pytest.mark.parametrize("plain", [False, True], ids=["sharded", "plain"])
def test_one_found_inf_agreement_per_step(pool, plain):
    assert pool.run(agreements_task, plain, world_size=2, timeout=30) == [1, 1]


# ------------------------------------------------------------------ who declares the contract
def contract_task(ctx):
    """torch's ``_step_supports_amp_scaling`` as torch's GradScaler and Lightning read it
    (``getattr(optimizer, "_step_supports_amp_scaling", False)``), per setup."""
    from oss_plus import ShardedDataParallel
    from oss_plus.compat import fairscale
    from oss_plus.compat import torch as torch_compat

    def flag(opt):
        return getattr(opt, "_step_supports_amp_scaling", False)

    found = {}
    for name, make in (
        ("oss", lambda ps: OSS(ps, group=ctx.group, lr=0.1)),
        ("fairscale", lambda ps: fairscale.OSS(ps, group=ctx.group, lr=0.1)),
        (
            "torch",
            lambda ps: torch_compat.ZeroRedundancyOptimizer(
                ps, torch.optim.SGD, process_group=ctx.group, lr=0.1
            ),
        ),
    ):
        zero1 = make(make_model().parameters())
        model = make_model()
        zero2 = make(model.parameters())
        ShardedDataParallel(model, zero2, ctx.group)
        found[name] = (flag(zero1), flag(zero2))
    return found


def test_the_contract_is_declared_where_the_scaler_cannot_see_every_gradient(pool):
    """ZeRO-1 keeps torch's classic path (every rank holds every averaged gradient; Lightning
    clips only optimizers without the flag); ShardedDataParallel declares it on OSS; the
    fairscale and torch adapters never (their classes have no such contract)."""
    for found in pool.run(contract_task, world_size=2, timeout=60):
        assert found == {"oss": (False, True), "fairscale": (False, False), "torch": (False, False)}
