"""Every optimizer class of the installed ecosystem packages through the cross-param probe,
against an independent reference (issue 54): the rule must hold for the ones nobody named.

For each class the probe's verdict is taken as OSS takes it (``coupling.probe``, the
package's defaults and ``lr=1e-3``). Every class it accepts is then run two ways on a small
model, as sharding runs it: one instance over every param, and two instances over two halves
of the params, on the same gradients, over steps at three gradient scales; the params must
stay bit-identical. (A refusal is always safe; what must never happen is an accepted class
that reads across params.) Nothing here lists a class by name: the classes are whatever
``pytorch_optimizer``, ``torch_optimizer``, timm's optimizers, ``came_pytorch``,
``prodigyopt``, ``dadaptation``, ``prodigyplus``, ``schedulefree`` and ``lion_pytorch``
export (the ``zoo`` extra; heavyball's compiled classes are in tests/test_zoo.py).

timm's package imports torchvision, whose wheel does not load on this CPU torch; its
optimizer modules import nothing of it, so :func:`timm_optimizers` loads them under a bare
``timm.optim`` package (``docs/optimizers.md``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
import warnings

import pytest
import torch

from oss_plus.step import coupling

PACKAGES = (
    "pytorch_optimizer",
    "torch_optimizer",
    "came_pytorch",
    "prodigyopt",
    "dadaptation",
    "prodigyplus",
    "schedulefree",
    "lion_pytorch",
)
STEPS = 12


def timm_optimizers() -> dict[str, type]:
    """timm's optimizer classes, loaded without ``timm/__init__.py`` (torchvision)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        return {}
    root = os.path.dirname(spec.origin)
    saved = {k: sys.modules.get(k) for k in ("timm", "timm.optim")}
    found: dict[str, type] = {}
    try:
        for name, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
        for file in sorted(os.listdir(os.path.join(root, "optim"))):
            if not file.endswith(".py") or file.startswith("_"):
                continue
            try:
                module = importlib.import_module(f"timm.optim.{file[:-3]}")
            except ImportError:  # optim_factory: timm's models (torchvision)
                continue
            found.update(_classes(module, "timm"))
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return found


def _classes(module: types.ModuleType, prefix: str) -> dict[str, type]:
    return {
        f"{prefix}.{name}": cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls)
        and issubclass(cls, torch.optim.Optimizer)
        and cls.__module__.startswith(prefix.split(".")[0])
    }


def every_class() -> dict[str, type]:
    found: dict[str, type] = {}
    for package in PACKAGES:
        if importlib.util.find_spec(package) is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found.update(_classes(importlib.import_module(package), package))
    found.update(timm_optimizers())
    return dict(sorted(found.items()))


CLASSES = every_class()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _kwargs(cls: type) -> dict:
    try:
        takes_lr = "lr" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        takes_lr = False
    return {"lr": 1e-3} if takes_lr else {}


def _step(opt, loss):
    try:
        opt.step()
    except Exception:  # noqa: BLE001 - a step that needs a closure gets the loss
        opt.step(lambda: loss)


def _sharded_like_runs_agree(cls: type, kwargs: dict) -> bool:
    """One instance over every param against two over halves, bit for bit."""
    whole, halves = _model(), _model()
    params, split = list(whole.parameters()), list(halves.parameters())
    opts = [[cls(params, **kwargs)], [cls(split[:2], **kwargs), cls(split[2:], **kwargs)]]
    for group in opts:
        for opt in group:
            if callable(getattr(opt, "train", None)):
                opt.train()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    for s in range(STEPS):
        scale = (1.0, 1e3, 1e-3)[s % 3]
        for model, group in ((whole, opts[0]), (halves, opts[1])):
            for opt in group:
                opt.zero_grad()
            with torch.enable_grad():
                loss = (model(x) ** 2).mean() * scale
                loss.backward(create_graph=True)
            torch.manual_seed(100 + s)
            for opt in group:
                _step(opt, loss.detach())
        if not all(_same_bits(a, b) for a, b in zip(params, split)):
            return False
    return True


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN: DualAdam reaches NaN at the 1e-3 scale)."""
    return torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))


@pytest.mark.skipif(not CLASSES, reason="no zoo package is installed (the zoo extra)")
@pytest.mark.filterwarnings("ignore")
def test_no_accepted_optimizer_reads_across_params():
    accepted, refused, wrong = [], [], []
    for name, cls in CLASSES.items():
        kwargs = _kwargs(cls)
        groups = [{"params": list(_model().parameters()), **kwargs}]
        found = coupling.probe(cls, dict(kwargs), groups, coupling._hyper)
        if found is not None and found.coupled:
            refused.append(name)
            assert "allow_cross_param=True" in found.message()
            continue
        accepted.append(name)
        try:
            agree = _sharded_like_runs_agree(cls, kwargs)
        except Exception as exc:  # noqa: BLE001 - one that cannot run as two instances
            agree = False
            name = f"{name} ({type(exc).__name__})"
        if not agree:
            wrong.append(name)
    assert not wrong, f"accepted, but one instance differs from two over halves: {wrong}"
    assert len(accepted) > 100 and refused, (len(accepted), len(refused))
