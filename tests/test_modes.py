"""``OSS.train()`` / ``OSS.eval()``: schedule-free optimizers through the sharded optimizer.

Every run trains ``DDP + OSS`` and ``DDP + the plain optimizer`` (unsharded) side by side
and compares the params bit for bit (fp32) after train steps, after ``eval()``, after
``train()`` again and after more steps, on every rank; ``eval()`` really moves the params
(a forwarder that did nothing would fail the comparison). The compressed wire, ZeRO-2,
``attach``, the flat rule, the adapters and the state round trips each get their scenario.
"""

from __future__ import annotations

import functools
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import catch, clone_model, ddp_of, flat_params, make_model, overlap_loss
from test_arrival import short_arrival, wait_for
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from oss_plus import OSS, ShardedDataParallel, load_checkpoint, save_checkpoint
from oss_plus.compat.fairscale import OSS as FairscaleOSS
from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.runtime import arrival as _arrival
from oss_plus.step.modes import NO_MODE, current_mode
from oss_plus.wire.main.region import MAIN_KEY

schedulefree = pytest.importorskip("schedulefree", reason="pip install schedulefree")
try:
    import pytorch_optimizer
except ImportError:  # its entry is left out
    pytorch_optimizer = None


def sf_wrapper(params, lr, momentum=0.9):
    """schedulefree's ScheduleFreeWrapper over SGD (not a torch.optim.Optimizer itself)."""
    return schedulefree.ScheduleFreeWrapper(torch.optim.SGD(params, lr=lr), momentum=momentum)


#: name -> (class, kwargs): every schedule-free optimizer the suite covers.
SCHEDULE_FREE = {
    "adamw_sf": (schedulefree.AdamWScheduleFree, {"lr": 0.01, "weight_decay": 0.01}),
    "sgd_sf": (schedulefree.SGDScheduleFree, {"lr": 0.1}),
    "radam_sf": (schedulefree.RAdamScheduleFree, {"lr": 0.01, "silent_sgd_phase": False}),
    "wrapper_sf": (sf_wrapper, {"lr": 0.1}),
}
#: The classes the flat rule accepts (step.pieces.ELEMENTWISE_NAMES).
FLAT = ["adamw_sf", "sgd_sf", "radam_sf"]
if pytorch_optimizer is not None:
    SCHEDULE_FREE["po_adamw_sf"] = (pytorch_optimizer.ScheduleFreeAdamW, {"lr": 0.01})
    FLAT.append("po_adamw_sf")
STEPS = 3


def _build(kind, ctx, params, name, **options):
    cls, kwargs = SCHEDULE_FREE[name]
    kwargs = {**kwargs, **{k: options.pop(k) for k in ("lr",) if k in options}}
    if kind == "plain":
        return cls(params, **kwargs)
    if kind == "fairscale":
        return FairscaleOSS(params, optim=cls, group=ctx.group, **options, **kwargs)
    if kind == "torch":
        return ZeroRedundancyOptimizer(params, cls, process_group=ctx.group, **kwargs)
    return OSS(params, optim=cls, group=ctx.group, **options, **kwargs)


def _steps(ddp, opt, start, steps, rank):
    for it in range(start, start + steps):
        opt.zero_grad()
        overlap_loss(ddp, it, rank).backward()
        opt.step()


def lockstep_task(ctx, names, kind="oss", attach=False, **options):
    """:func:`lockstep` of every optimizer of ``names``."""
    return {name: lockstep(ctx, name, kind, attach, **options) for name in names}


def lockstep(ctx, name, kind, attach, **options):
    """train, steps, eval, eval again, train, steps: OSS and the plain optimizer."""
    model = make_model(depth=3)
    ref_model = clone_model(model)
    ddp, ref_ddp = ddp_of(ctx, model), ddp_of(ctx, ref_model)
    opt = _build(kind, ctx, model.parameters(), name, **options)
    ref = _build("plain", ctx, ref_model.parameters(), name)
    if attach:
        opt.attach(ddp)
    out = {"has": (hasattr(opt, "train"), hasattr(opt, "eval"))}
    stages = [
        ("train", lambda o: o.train()),
        ("steps", lambda o: None),
        ("eval", lambda o: o.eval()),
        ("eval_again", lambda o: o.eval()),
        ("train_again", lambda o: o.train()),
        ("more_steps", lambda o: None),
    ]
    for stage, call in stages:
        for d, o in ((ddp, opt), (ref_ddp, ref)):
            call(o)
            if stage.endswith("steps"):
                _steps(d, o, 0 if stage == "steps" else STEPS, STEPS, ctx.rank)
        opt.settle() if hasattr(opt, "settle") else None
        out[stage] = (flat_params(model), flat_params(ref_model))
    out["mode"] = current_mode(opt.param_groups, opt.optim)
    out["split"] = len(opt.plan.split)
    return out


def _assert_lockstep(results):
    for name in results[0]:
        _assert_lockstep_of([r[name] for r in results])


def _assert_lockstep_of(results):
    for r in results:
        assert r["has"] == (True, True)
        for stage in ("train", "steps", "eval", "eval_again", "train_again", "more_steps"):
            got, want = r[stage]
            assert torch.equal(got, want), stage
            assert torch.equal(got, results[0][stage][0]), stage  # every replica alike
        assert not torch.equal(r["steps"][1], r["eval"][1])  # eval() moved the params
        assert r["mode"] is True


@pytest.mark.parametrize("world", [2, 3], ids=["ws2", "ws3"])
def test_train_and_eval_match_the_unsharded_optimizer(pool, world):
    _assert_lockstep(pool.run(lockstep_task, list(SCHEDULE_FREE), world_size=world))


@pytest.mark.parametrize("kind", ["fairscale", "torch"])
def test_adapters_forward_train_and_eval(pool, kind):
    _assert_lockstep(pool.run(lockstep_task, ["adamw_sf"], kind, world_size=2))


def test_attached_sync_is_settled_first(pool):
    _assert_lockstep(pool.run(lockstep_task, ["adamw_sf"], attach=True, world_size=2))


@pytest.mark.parametrize("world", [2, 3], ids=["ws2", "ws3"])
def test_flat_rule_pieces_swap_exactly(pool, world):
    results = pool.run(lockstep_task, FLAT, partition_rule="flat", world_size=world)
    _assert_lockstep(results)
    assert all(results[0][name]["split"] > 0 for name in FLAT)  # params cut into pieces


def refresh_task(ctx):
    """The wrapper keeps its mode on itself: a repartition that rebuilds the inner optimizer
    (a param frozen) keeps it, and training goes on as the plain wrapper's."""
    model = make_model(depth=3)
    ref_model = clone_model(model)
    opt = _build("oss", ctx, model.parameters(), "wrapper_sf")
    ref = _build("plain", ctx, ref_model.parameters(), "wrapper_sf")
    for m in (model, ref_model):
        m[0].weight.requires_grad_(False)
    for m, o in ((model, opt), (ref_model, ref)):
        o.train()
        for it in range(STEPS):
            o.zero_grad()
            overlap_loss(m, it, 0).backward()
            o.step()
        o.eval()
    return current_mode(opt.param_groups, opt.optim), flat_params(model), flat_params(ref_model)


def test_a_rebuilt_inner_wrapper_keeps_its_mode(pool):
    for mode, got, want in pool.run(refresh_task, world_size=2):
        assert mode is False and torch.equal(got, want)


def zero2_task(ctx, name):
    """ZeRO-2 (oss_plus.ShardedDataParallel) + OSS against DDP + the plain optimizer."""
    model = make_model(depth=3)
    ref_model = clone_model(model)
    opt = _build("oss", ctx, model.parameters(), name)
    sdp = ShardedDataParallel(model, opt, process_group=ctx.group)
    ref_ddp = ddp_of(ctx, ref_model)
    ref = _build("plain", ctx, ref_model.parameters(), name)
    out = []
    for stage in ("train", "steps", "eval", "train", "steps"):
        for d, o in ((sdp, opt), (ref_ddp, ref)):
            if stage == "steps":
                _steps(d, o, len(out), STEPS, ctx.rank)
            else:
                getattr(o, stage)()
        out.append((flat_params(model), flat_params(ref_model)))
    return out


def test_zero2(pool):
    for r in pool.run(zero2_task, "adamw_sf", world_size=2):
        assert all(torch.equal(got, want) for got, want in r)


def wire_task(ctx, rule):
    """Steps on a bf16 wire, then eval() and train(): the plain optimizer steps the same
    gradients (those of the rounded params every replica holds), so its params are the
    exact values the owners keep (main copies); every replica holds them rounded."""
    model = make_model(depth=3)
    ref_model = clone_model(model)
    ddp = ddp_of(ctx, model)
    options = {"broadcast_dtype": torch.bfloat16, "partition_rule": rule}
    opt = _build("oss", ctx, model.parameters(), "adamw_sf", **options)
    ref = _build("plain", ctx, ref_model.parameters(), "adamw_sf")
    out = []
    for stage in ("train", "steps", "eval", "train", "steps", "eval"):
        if stage == "steps":
            for it in range(2):
                opt.zero_grad()
                overlap_loss(ddp, it, ctx.rank).backward()
                for p, q in zip(model.parameters(), ref_model.parameters()):
                    q.grad = p.grad.clone()  # before the step: schedule-free divides it
                opt.step()
                ref.step()
        else:
            getattr(opt, stage)()
            getattr(ref, stage)()
        want = flat_params(ref_model)
        exact = opt.export_local_state()
        refs = list(ref_model.parameters())
        mains = [
            torch.equal(s[MAIN_KEY].reshape(-1), _of(refs[i], opt, i, ctx.rank))
            for i, s in exact.items()
            if MAIN_KEY in s
        ]
        rounded = want.to(torch.bfloat16).float()
        out.append((torch.equal(flat_params(model), rounded), mains, torch.equal(rounded, want)))
    return out


def _of(ref_param, opt, i, rank):
    piece = opt.plan.piece(rank, i)
    flat = ref_param.detach().reshape(-1)
    return flat if piece is None else flat[piece.start : piece.end]


@pytest.mark.parametrize("rule", [None, "flat"], ids=["default", "flat"])
def test_compressed_wire_main_copies_follow_the_swap(pool, rule):
    results = pool.run(wire_task, rule, world_size=2)
    for r in results:
        for rounded_equal, mains, _ in r:
            assert rounded_equal and all(mains)
    assert any(r[2][1] for r in results)  # some rank holds main copies after eval()
    assert not any(r[2][2] for r in results)  # and the wire really rounds


def missing_task(ctx):
    model = make_model(depth=1)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    try:
        opt.train()
    except AttributeError as exc:
        return hasattr(opt, "train"), hasattr(opt, "eval"), str(exc)
    return None


def test_absent_when_the_inner_optimizer_has_no_modes(pool):
    for r in pool.run(missing_task, world_size=2):
        assert r == (False, False, NO_MODE.format(name="train", cls="SGD"))


class _FailingEval(schedulefree.SGDScheduleFree):
    def eval(self):
        if torch.distributed.get_rank() == 1:
            raise ValueError("eval failed here")
        super().eval()


def failing_task(ctx):
    model = make_model(depth=1)
    opt = OSS(model.parameters(), optim=_FailingEval, group=ctx.group, lr=0.1)
    opt.train()
    try:
        opt.eval()
    except ValueError as exc:
        return str(exc)
    return None


def test_an_error_on_one_rank_is_raised_on_every_rank(pool):
    results = pool.run(failing_task, world_size=2)
    assert all(r is not None for r in results), results
    assert "eval failed here" in results[1]


def skip_task(ctx):
    """A call in the current mode neither syncs nor touches the params."""
    model = make_model(depth=1)
    opt = OSS(model.parameters(), optim=schedulefree.SGDScheduleFree, group=ctx.group, lr=0.1)
    opt.train()
    calls = []
    opt.sync.sync = functools.partial(lambda *a: calls.append(a))
    for _ in range(3):
        opt.train()
    return len(calls)


def test_a_call_in_the_current_mode_communicates_nothing(pool):
    assert pool.run(skip_task, world_size=2) == [0, 0]


def _save(kind, ctx, model, opt, path):
    if kind == "state_dict":
        opt.consolidate_state_dict(recipient_rank=-1)
        return opt.state_dict(all_ranks=True)
    if kind == "checkpoint":
        save_checkpoint(opt, path)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=ctx.group
        )
    return None


def _load(kind, ctx, model, opt, path, saved):
    if kind == "state_dict":
        opt.load_state_dict(saved)
    elif kind == "checkpoint":
        load_checkpoint(opt, path)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=ctx.group
        )
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def roundtrip_task(ctx, kind, path):
    """Saved in eval mode, loaded into a fresh optimizer put in train mode: the mode comes
    back as the plain optimizer's ``load_state_dict`` brings it, and the next train()
    moves the params as the plain optimizer's does."""
    model = make_model(depth=3)
    ref_model = clone_model(model)
    ddp, ref_ddp = ddp_of(ctx, model), ddp_of(ctx, ref_model)
    opt = _build("oss", ctx, model.parameters(), "adamw_sf")
    ref = _build("plain", ctx, ref_model.parameters(), "adamw_sf")
    for d, o in ((ddp, opt), (ref_ddp, ref)):
        o.train()
        _steps(d, o, 0, STEPS, ctx.rank)
        o.eval()
    saved, ref_saved = _save(kind, ctx, model, opt, path), ref.state_dict()
    model2, ref_model2 = clone_model(model), clone_model(ref_model)  # the eval point
    ddp2, ref_ddp2 = ddp_of(ctx, model2), ddp_of(ctx, ref_model2)
    opt2 = _build("oss", ctx, model2.parameters(), "adamw_sf", lr=0.5)
    ref2 = _build("plain", ctx, ref_model2.parameters(), "adamw_sf")
    opt2.train()
    ref2.train()
    _load(kind, ctx, model2, opt2, path, saved)
    ref2.load_state_dict(ref_saved)
    modes = (current_mode(opt2.param_groups, opt2.optim), ref2.param_groups[0]["train_mode"])
    out = []
    for d, o in ((ddp2, opt2), (ref_ddp2, ref2)):
        o.train()
        out.append(flat_params(d.module))
        _steps(d, o, STEPS, 2, ctx.rank)
        o.eval()
        out.append(flat_params(d.module))
    return modes, out


@pytest.mark.parametrize("kind", ["state_dict", "checkpoint", "dcp"])
def test_the_mode_survives_state_round_trips(pool, tmp_path, kind):
    for modes, (train_got, eval_got, train_want, eval_want) in pool.run(
        roundtrip_task, kind, str(tmp_path / "ckpt"), world_size=2
    ):
        assert modes == (False, False)
        assert torch.equal(train_got, train_want) and torch.equal(eval_got, eval_want)


def alone_task(ctx, tag):
    """Rank 1 calls eval() alone: it raises naming the call instead of hanging; then every
    rank calls it and training goes on."""
    model = make_model(depth=1)
    opt = OSS(model.parameters(), optim=schedulefree.SGDScheduleFree, group=ctx.group, lr=0.1)
    opt.train()
    _steps(model, opt, 0, 1, 0)
    with short_arrival():
        store = _arrival._store()
        alone = None
        if ctx.rank == 1:
            alone = catch(opt.eval)
            store.add(f"{tag}/done", 1)
        else:
            wait_for(store, f"{tag}/done", 1)
        together = catch(opt.eval)
    return alone, together[0], flat_params(model)


def test_a_call_on_some_ranks_raises_there(pool):
    results = pool.run(alone_task, f"test_modes/{uuid.uuid4().hex}", world_size=2)
    assert results[0][0] is None
    kind, message = results[1][0]
    assert kind == "RuntimeError" and message.startswith("eval() is collective"), message
    assert [r[1] for r in results] == ["ok", "ok"]
    assert torch.equal(results[0][2], results[1][2])
