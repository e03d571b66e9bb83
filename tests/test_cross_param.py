"""Optimizers whose update of one param reads the others (issue 49, item 3).

Prodigy and D-Adaptation size their step from sums over every param; under sharding each rank
would sum over its own shard and drift silently. ``oss_plus.step.coupling`` probes the
optimizer at construction (two small copies of the params, stepped with and without each
other) and OSS refuses on every rank what reads across params, unless ``allow_cross_param``.
The references are the optimizers themselves: the unsharded run, and, for the verdicts, the
packages' own classes (no class name is listed anywhere in oss_plus).
"""

from __future__ import annotations

import importlib
import importlib.util
from unittest import mock

import pytest
import torch

from oss_plus import OSS
from oss_plus.step import coupling
from tests.helpers import catch


def _has(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class GlobalNormSGD(torch.optim.Optimizer):
    """An optimizer nobody has named: SGD on the gradient divided by the norm over every
    param (as a global clip would)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / (norm + 1e-6), alpha=group["lr"])


class NoisySGD(torch.optim.SGD):
    """Per param, but draws random numbers in its step (as stochastic rounding does)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(torch.randn_like(p), alpha=1e-3)
        return super().step(closure)


class NeedsClosure(torch.optim.SGD):
    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("NeedsClosure needs a closure")
        return super().step(closure)


def _po(name):
    import pytorch_optimizer

    return getattr(pytorch_optimizer, name)


#: id -> (package needed, factory of (constructor, kwargs), only 2-D params)
PER_PARAM = {
    "SGD": (None, lambda: (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), False),
    "AdamW": (None, lambda: (torch.optim.AdamW, {"lr": 1e-3}), False),
    "Adafactor": (None, lambda: (torch.optim.Adafactor, {"lr": 1e-2}), False),
    "Muon": (None, lambda: (torch.optim.Muon, {"lr": 1e-2}), True),
    **{
        f"po-{n}": ("pytorch_optimizer", (lambda n=n: (_po(n), {"lr": 1e-3})), False)
        for n in ("Lion", "ADOPT", "Shampoo", "Lamb", "AdEMAMix", "Adan", "StableAdamW", "SOAP")
    },
    "po-ScheduleFreeAdamW": ("pytorch_optimizer", lambda: (_po("ScheduleFreeAdamW"), {}), False),
    "sf-AdamW": ("schedulefree", lambda: (_sf("AdamWScheduleFree"), {"lr": 1e-3}), False),
    "sf-SGD": ("schedulefree", lambda: (_sf("SGDScheduleFree"), {"lr": 1e-3}), False),
    "sf-RAdam": ("schedulefree", lambda: (_sf("RAdamScheduleFree"), {"lr": 1e-3}), False),
    "heavyball-AdamW": ("heavyball", lambda: (_hb("AdamW"), {"lr": 1e-3}), False),
    "lion_pytorch": ("lion_pytorch", lambda: (_lion(), {"lr": 1e-4}), False),
}
CROSS = {
    "GlobalNormSGD": (
        None,
        lambda: (GlobalNormSGD, {"lr": 0.1}),
        "the value of param 0 is computed from param 0 and param 1 (at probe step 1; they "
        "first meet in aten.stack)",
    ),
    "NoisySGD": (None, lambda: (NoisySGD, {"lr": 0.1}), "draws random numbers"),
    "po-Prodigy": (
        "pytorch_optimizer",
        lambda: (_po("Prodigy"), {"lr": 1.0}),
        "param 0 and param 1",
    ),
    "po-DAdaptAdam": (
        "pytorch_optimizer",
        lambda: (_po("DAdaptAdam"), {"lr": 1.0}),
        "param 0 and param 1",
    ),
    "prodigyopt": ("prodigyopt", lambda: (_prodigy(), {"lr": 1.0}), "param 0 and param 1"),
    "dadaptation-Adam": (
        "dadaptation",
        lambda: (_dadapt("DAdaptAdam"), {"lr": 1.0}),
        "param 0 and param 1",
    ),
    "dadaptation-SGD": (
        "dadaptation",
        lambda: (_dadapt("DAdaptSGD"), {"lr": 1.0}),
        "param 0 and param 1",
    ),
    "dadaptation-Lion": (
        "dadaptation",
        lambda: (_dadapt("DAdaptLion"), {"lr": 1.0}),
        "param 0 and param 1",
    ),
    # issue 54: accepted before (the probe could not step them, or their coupling did not
    # move a value within its three steps), now refused with what they read
    "po-AliG (closure)": (
        "pytorch_optimizer",
        lambda: (_po("AliG"), {"max_lr": 1.0}),
        "is read on the host by .item(), float(), int() or bool()",
    ),
    "po-AdaHessian (Hessian)": (
        "pytorch_optimizer",
        lambda: (_po("AdaHessian"), {"lr": 0.1}),
        "they first meet in torch.autograd.grad",
    ),
    "po-DAdaptLion": (
        "pytorch_optimizer",
        lambda: (_po("DAdaptLion"), {"lr": 1.0}),
        "param 0 and param 1",
    ),
    "ProdigyPlusScheduleFree": (
        "prodigyplus",
        lambda: (_attr("prodigyplus", "ProdigyPlusScheduleFree"), {"lr": 1.0}),
        "param 0 and param 1 is read on the host",
    ),
}


def _attr(module, name):
    return getattr(importlib.import_module(module), name)


def _sf(name):
    import schedulefree

    return getattr(schedulefree, name)


def _hb(name):
    import heavyball

    return getattr(heavyball, name)


def _lion():
    import lion_pytorch

    return lion_pytorch.Lion


def _prodigy():
    import prodigyopt

    return prodigyopt.Prodigy


def _dadapt(name):
    import dadaptation

    return getattr(dadaptation, name)


def _cases(table):
    return [
        pytest.param(
            name,
            id=name,
            marks=pytest.mark.skipif(
                bool(need) and not _has(need), reason=f"{need} is not installed"
            ),
        )
        for name, (need, *_) in table.items()
    ]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _lockstep(pairs, steps: int) -> None:
    """Train each (model, optimizer) pair on the same batches, step by step."""
    for step in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        for m, o in pairs:
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()


def _probe(factory, only_2d=False):
    cls, kwargs = factory()
    params = [p for p in _model().parameters() if p.ndim == 2 or not only_2d]
    groups = [{"params": params, **kwargs}]
    return coupling.probe(cls, kwargs, groups, coupling._hyper)


# ------------------------------------------------------------------ the probe, pure
@pytest.mark.parametrize("name", _cases(PER_PARAM))
def test_the_probe_finds_per_param_optimizers_per_param(name):
    _, factory, only_2d = PER_PARAM[name]
    found = _probe(factory, only_2d)
    assert found is not None and not found.coupled, found


@pytest.mark.parametrize("name", _cases(CROSS))
def test_the_probe_finds_optimizers_that_read_across_params(name):
    _, factory, what = CROSS[name]
    found = _probe(factory)
    assert found is not None and found.coupled
    cls = factory()[0]
    assert found.name == cls.__name__ and what in found.message()
    assert "allow_cross_param=True" in found.message()


def test_the_probe_s_optimizers_are_marked():
    made = []

    def recording(groups, **kw):
        made.append(torch.optim.SGD(groups, **kw))
        return made[-1]

    coupling.probe(recording, {"lr": 0.1}, [{"params": list(_model().parameters()), "lr": 0.1}],
                   coupling._hyper)  # fmt: skip
    # two traced runs (one group; the other order in two, with a closure), four of the
    # value witness (both orders, with and without the other param)
    assert len(made) == 6 and all(opt.oss_plus_probe for opt in made)


def test_the_probe_leaves_the_training_s_random_generator_alone():
    before = torch.random.get_rng_state()
    _probe(CROSS["NoisySGD"][1])
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_step_that_needs_a_closure_gets_one():
    found = _probe(lambda: (NeedsClosure, {"lr": 0.1}))
    assert found is not None and not found.coupled, found


class NeverSteps(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("NeverSteps cannot step")


def test_what_cannot_step_the_probe_is_refused_with_each_way_tried():
    found = _probe(lambda: (NeverSteps, {"lr": 0.1}))
    assert found is not None and found.coupled and found.difference is None
    message = found.message()
    assert message.startswith("oss_plus cannot show that NeverSteps updates each param")
    for way in ("gradients set before it", "a closure", "gradients that carry their graph"):
        assert f"{way} (RuntimeError: NeverSteps cannot step)" in message
    assert "allow_cross_param=True" in message


def test_the_verdict_is_kept_per_optimizer_and_shapes():
    calls = []

    def counting(groups, **kw):
        calls.append(1)
        return torch.optim.SGD(groups, **kw)

    groups = [{"params": list(_model().parameters()), "lr": 0.1}]
    for _ in range(3):
        coupling.check(counting, {"lr": 0.1}, groups, coupling._hyper)
    assert len(calls) == 6  # one probe (test_the_probe_s_optimizers_are_marked)
    coupling.check(counting, {"lr": 0.2}, groups, coupling._hyper)  # other hyperparameters
    assert len(calls) == 12


# ------------------------------------------------------------------ OSS, on every rank
def refuse_task(ctx, name):
    _, factory, _ = CROSS[name]
    cls, kwargs = factory()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.random.get_rng_state()
    from oss_plus.compat.fairscale import OSS as FairscaleOSS
    from oss_plus.compat.torch import ZeroRedundancyOptimizer

    results = [
        catch(OSS, model.parameters(), optim=cls, group=ctx.group, **kwargs),
        catch(FairscaleOSS, model.parameters(), optim=cls, group=ctx.group, **kwargs),
        catch(ZeroRedundancyOptimizer, model.parameters(), cls, process_group=ctx.group, **kwargs),
    ]
    untouched = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return results, untouched and torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.parametrize("name", _cases({k: CROSS[k] for k in ("GlobalNormSGD", "po-Prodigy")}))
@pytest.mark.parametrize("ranks", [(0, 1), (2, 3)], ids=["pair", "offset-pair"])
def test_oss_and_both_adapters_refuse_on_every_rank(pool, name, ranks):
    results = pool.run(refuse_task, name, ranks=ranks, timeout=60)
    cls_name = CROSS[name][1]()[0].__name__
    for per_adapter, untouched in results:
        assert untouched
        for kind, message in per_adapter:
            assert kind == "ValueError", message
            assert message.startswith(f"{cls_name} cannot be sharded as it is"), message
    assert len({str(r[0]) for r in results}) == 1  # the same error on every rank


#: The packages' own reduction over the ranks (``fsdp_in_use=True``): module, class.
FLAGGED = {"prodigyopt": ("prodigyopt", "Prodigy"), "dadaptation": ("dadaptation", "DAdaptAdam")}


def allowed_task(ctx, name, flag):
    """``allow_cross_param``: OSS shards the optimizer; with ``fsdp_in_use`` the package
    all-reduces its sums itself. Returns the gap to the unsharded run and this rank's params."""
    cls = getattr(importlib.import_module(FLAGGED[name][0]), FLAGGED[name][1])
    kwargs = {"lr": 1.0, "fsdp_in_use": flag}
    ref_model, model = _model(), _model()
    ref = cls(ref_model.parameters(), **{**kwargs, "fsdp_in_use": False})
    # the packages reduce on a tensor they put on the GPU (torch.zeros(2).cuda()): on this
    # CPU machine it stays on the CPU, where gloo reduces it
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        opt = OSS(model.parameters(), optim=cls, group=ctx.group, allow_cross_param=True,
                  **kwargs)  # fmt: skip
        _lockstep(((ref_model, ref), (model, opt)), 8)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref_flat = torch.cat([p.detach().flatten() for p in ref_model.parameters()])
    return (flat - ref_flat).abs().max().item(), flat, float(opt.param_groups[0]["d"])


@pytest.mark.parametrize("name", _cases({k: (k,) for k in FLAGGED}))
def test_the_packages_own_reduction_keeps_the_unsharded_run_within_summation_tolerance(pool, name):
    reduced = pool.run(allowed_task, name, True, world_size=4, timeout=60)
    drifted = pool.run(allowed_task, name, False, world_size=4, timeout=60)
    for results in (reduced, drifted):  # every replica identical, bit for bit
        assert all(torch.equal(r[1], results[0][1]) for r in results)
    assert len({r[2] for r in reduced}) == 1  # and the same d (each rank's own without the flag)
    gap, drift = reduced[0][0], drifted[0][0]
    assert gap <= 1e-6, gap  # float summation order only (measured: docs/optimizers.md)
    assert drift > 100 * max(gap, 1e-9), (gap, drift)  # without the flag, the drift is real


def flag_task(ctx, allow):
    import prodigyopt

    model = _model()
    kwargs = {"lr": 1.0, "fsdp_in_use": True}
    return catch(OSS, model.parameters(), optim=prodigyopt.Prodigy, group=ctx.group,
                 allow_cross_param=allow, **kwargs)  # fmt: skip


def test_the_flag_needs_allow_and_the_default_group(pool):
    pytest.importorskip("prodigyopt")
    for kind, message in pool.run(flag_task, False, world_size=4, timeout=60):
        assert kind == "ValueError" and "pass allow_cross_param=True" in message
    for kind, message in pool.run(flag_task, True, world_size=2, timeout=60):
        assert kind == "ValueError" and "spread over 2 of the 4 ranks" in message


def one_rank_task(ctx):
    """At world size 1 nothing is sharded: Prodigy is exact, no probe, no refusal."""
    import pytorch_optimizer

    ref_model, model = _model(), _model()
    ref = pytorch_optimizer.Prodigy(ref_model.parameters(), lr=1.0)
    opt = OSS(model.parameters(), optim=pytorch_optimizer.Prodigy, group=ctx.group, lr=1.0)
    _lockstep(((ref_model, ref), (model, opt)), 4)
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_at_one_rank_nothing_is_refused(pool):
    pytest.importorskip("pytorch_optimizer")
    assert pool.run(one_rank_task, world_size=1, timeout=60) == [True]


def test_allow_cross_param_must_be_a_bool():
    oss = mock.Mock(allow_cross_param="yes", group=None, param_groups=[], replicate_group=None)
    with pytest.raises(TypeError, match="allow_cross_param must be False"):
        coupling.refuse_cross_param(torch.optim.SGD, {}, oss)


def test_a_constructor_that_refuses_the_probe_s_params_is_refused_with_its_error():
    found = _probe(lambda: (torch.optim.Muon, {"lr": 1e-2}))  # a bias among them
    assert found is not None and found.coupled
    assert "its constructor refused the probe's copies of param 0 and param 1 (ValueError: " in (
        found.message()
    )


class PlainAdamW(torch.optim.AdamW):
    """A subclass: it may change the update, so it is probed."""


def probed_task(ctx):
    calls = []
    real = coupling._probe

    def counting(constructor, *args):
        calls.append(getattr(constructor, "__name__", "?"))
        return real(constructor, *args)

    coupling._verdicts.clear()
    with mock.patch.object(coupling, "_probe", counting):
        for cls in (torch.optim.AdamW, torch.optim.SGD, PlainAdamW):
            OSS(_model().parameters(), optim=cls, group=ctx.group, lr=0.1)
    return calls


def test_torch_s_own_classes_are_not_probed_their_subclasses_are(pool):
    assert pool.run(probed_task, world_size=2, timeout=60) == [["PlainAdamW"]] * 2
    assert not coupling.needs_probe(torch.optim.Adam)
    assert coupling.needs_probe(PlainAdamW) and coupling.needs_probe(GlobalNormSGD)
