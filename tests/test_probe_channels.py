"""The cross-param probe against one synthetic optimizer per way a step can read across params
(issue 54): each is refused, with its real reason; per-param controls of the same shapes pass;
and removing any one of the probe's channels (``oss_plus.step.probe.runs.CHANNELS``) lets
its optimizer through or loses its reason.

Every synthetic optimizer is SGD plus one cross-param read, so each test also shows that the
probe does not refuse plain SGD (the controls).
"""

from __future__ import annotations

import math

import pytest
import torch

from oss_plus.step import coupling
from oss_plus.step.probe import runs as probe_runs


def _grads(group):
    return [p for p in group["params"] if p.grad is not None]


def _all(opt):
    return [p for g in opt.param_groups for p in _grads(g)]


class _SGD(torch.optim.Optimizer):
    """Plain SGD; subclasses add one read across params in :meth:`extra`."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def extra(self, p):  # what is added to p's update
        return 0.0

    @torch.no_grad()
    def step(self, closure=None):
        self.loss = None
        if closure is not None:
            with torch.enable_grad():
                self.loss = closure()
        self.prepare()
        for group in self.param_groups:
            for p in _grads(group):
                self.state[p]["n"] = self.state[p].get("n", 0) + 1
                p.sub_(group["lr"] * p.grad + self.extra(p))
        return self.loss

    def prepare(self):
        pass


def _global_norm(opt):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in _all(opt)]))


class GlobalNormTensor(_SGD):
    """A global norm through tensor ops."""

    def extra(self, p):
        return 1e-3 * _global_norm(self) * p.grad


class GlobalNormItem(_SGD):
    """The same through ``.item()``."""

    def extra(self, p):
        return 1e-3 * _global_norm(self).item() * p.grad


class GroupValue(_SGD):
    """A sum over the params kept in the param group (its updates stay per param)."""

    def prepare(self):
        for group in self.param_groups:
            group["grad_sum"] = sum(p.grad.sum().item() for p in _all(self))


class GlobalState(_SGD):
    """A global norm kept in a param's state (its updates stay per param)."""

    def prepare(self):
        for p in _all(self):
            self.state[p]["seen_norm"] = _global_norm(self)


class ClosureLoss(_SGD):
    """Scales every update by the closure's loss (a Polyak-like step size)."""

    def extra(self, p):
        return 0.0 if self.loss is None else 1e-3 * self.loss * p.grad


class HessianVector(_SGD):
    """A Hessian-vector product over every param (as AdaHessian): needs gradients that carry
    their graph."""

    def prepare(self):
        params = _all(self)
        if any(p.grad.grad_fn is None for p in params):
            raise RuntimeError("HessianVector needs backward(create_graph=True)")
        with torch.enable_grad():
            hvs = torch.autograd.grad(
                [p.grad for p in params], params, [torch.ones_like(p) for p in params]
            )
        for p, hv in zip(params, hvs):
            self.state[p]["hv"] = hv.detach()

    def extra(self, p):
        return 1e-3 * self.state[p]["hv"]


class DefaultRandom(_SGD):
    """A random draw per param from the default generator (stochastic rounding)."""

    def extra(self, p):
        return 1e-6 * torch.randn_like(p)


class LateCoupling(_SGD):
    """A global norm only from step 10 on."""

    def extra(self, p):
        late = self.state[p]["n"] >= 10
        return 1e-3 * _global_norm(self) * p.grad if late else 0.0


class ThresholdCoupling(_SGD):
    """A global norm only when this param's gradient is large (a clip that kicks in)."""

    def extra(self, p):
        if p.grad.abs().max() > 100:
            return 1e-3 * _global_norm(self) * p.grad
        return 0.0


class TinyCoupling(_SGD):
    """A coupling far below 1e-9 (it moves no float32 value)."""

    def extra(self, p):
        return 1e-30 * _global_norm(self)


class PythonSum(_SGD):
    """A sum over the params through Python's ``math`` (no trace of it survives: only the
    value witness sees it)."""

    def extra(self, p):
        total = math.fsum(q.grad.abs().sum().item() for q in _all(self))
        return 1e-3 * total * p.grad


# ---------------------------------------------------------------- per-param controls
class ForeachSGD(torch.optim.SGD):
    """torch's foreach kernels (a subclass is probed)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9, foreach=True)


class FusedAdamW(torch.optim.AdamW):
    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, fused=True)


class TrustRatio(_SGD):
    """Per-tensor norms stacked and unbound again (Lamb's trust ratio)."""

    def prepare(self):
        params = _all(self)
        w = torch.stack(torch._foreach_norm(params))
        g = torch.stack(torch._foreach_norm([p.grad for p in params]))
        for p, r in zip(params, torch.where(g > 0, w / (g + 1e-8), 1.0).unbind()):
            self.state[p]["ratio"] = r

    def extra(self, p):
        return 1e-3 * self.state[p]["ratio"] * p.grad


class OwnGenerator(_SGD):
    """A random draw per param from a generator of its own."""

    def extra(self, p):
        state = self.state[p]
        if "gen" not in state:
            state["gen"] = torch.Generator(device=p.device).manual_seed(p.numel())
        noise = torch.randn(p.shape, generator=state["gen"], device=p.device, dtype=p.dtype)
        return 1e-6 * noise


#: Refused: the class, the channel that must see it, and what its message says.
REFUSED = {
    "global norm (tensors)": (
        GlobalNormTensor,
        "param",
        "the value of param 0 is computed from param 0 and param 1",
    ),
    "global norm (.item())": (
        GlobalNormItem,
        "host",
        "is read on the host by .item(), float(), int() or bool()",
    ),
    "group value": (
        GroupValue,
        "group",
        "the param-group value 'grad_sum' is computed from param 0 and param 1",
    ),
    "state value": (
        GlobalState,
        "state",
        "the state ['seen_norm'] of param 0 is computed from param 0 and param 1",
    ),
    "closure's loss": (ClosureLoss, "closure", "they first meet in the closure's loss"),
    "Hessian-vector product": (HessianVector, "graph", "they first meet in torch.autograd.grad"),
    "random draw": (DefaultRandom, "random", "the draws of the default cpu generator reach"),
    "from step 10": (
        LateCoupling,
        "param",
        "is computed from param 0 and param 1 (at probe step 10;",
    ),
    "above a threshold": (
        ThresholdCoupling,
        "param",
        "is computed from param 0 and param 1 (at probe step 5;",
    ),
    "below 1e-9": (
        TinyCoupling,
        "param",
        "the value of param 0 is computed from param 0 and param 1",
    ),
    "Python arithmetic": (PythonSum, "witness", "the trace did not follow how"),
}
PER_PARAM = {
    "foreach": ForeachSGD,
    "fused": FusedAdamW,
    "per-tensor norms": TrustRatio,
    "per-param generator": OwnGenerator,
    "SGD": _SGD,
}


def _groups():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return [{"params": list(model.parameters()), "lr": 0.1}]


def _probe(cls):
    return coupling.probe(cls, {"lr": 0.1}, _groups(), coupling._hyper)


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_way_of_reading_across_params_is_refused_with_its_reason(case):
    cls, _, says = REFUSED[case]
    found = _probe(cls)
    assert found is not None and found.coupled and found.difference is not None, found
    assert says in found.message(), found.message()


@pytest.mark.parametrize("case", list(PER_PARAM))
def test_per_param_controls_pass(case):
    found = _probe(PER_PARAM[case])
    assert found is not None and not found.coupled, found


@pytest.mark.parametrize("case", list(REFUSED))
def test_without_its_channel_the_reason_is_lost(case, monkeypatch):
    cls, channel, says = REFUSED[case]
    monkeypatch.setattr(probe_runs, "CHANNELS", probe_runs.CHANNELS - {channel})
    found = _probe(cls)
    assert found is None or not found.coupled or says not in found.message(), found


def test_every_channel_is_needed_by_some_case():
    assert {channel for _, channel, _ in REFUSED.values()} == set(probe_runs.CHANNELS)


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_the_probe_runs_on_the_params_device(device):
    """The probe's copies take the params' device (CUDA tensors on a GPU)."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(3, 3, device=device)) for _ in range(2)]}]
    assert not coupling.probe(FusedAdamW, {"lr": 0.1}, groups, coupling._hyper).coupled
    found = coupling.probe(GlobalNormTensor, {"lr": 0.1}, groups, coupling._hyper)
    assert found.coupled and "param 0 and param 1" in found.message()
