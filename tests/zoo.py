"""The optimizers of the ecosystem the suite runs inside OSS (issue 49): module-level factories
the worker pool can ship, each returning ``(class or factory, kwargs)``, and what each needs.

The packages come with the ``zoo`` extra; a case whose package is missing is skipped. Their
verdicts under OSS are in docs/optimizers.md.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


@dataclass(frozen=True)
class Zoo:
    """One optimizer: its package, its factory, and what it steps."""

    need: str | None
    make: Callable[[], tuple[Any, dict[str, Any]]]
    #: steps 2-D params only (Muon): the model's biases are left to another optimizer
    matrices_only: bool = False
    #: its update is elementwise (the flat rule accepts it)
    elementwise: bool = False
    #: for the every-path harness: the state without what differs by design (see its doc)
    normalize: Callable[[dict], Any] | None = None
    #: runs the every-path harness (tests/test_zoo.py), which saves in train mode
    paths: bool = True
    #: DCP option sets refused at the save, with a fragment of the error (see state_paths.Case)
    refused: Mapping[str, str] = field(default_factory=dict)
    #: runs the harness under every rule of tests/test_zoo.py (else the default rule only:
    #: the rules differ in owners, the state paths are the same code; CI time)
    all_rules: bool = True
    #: keyword arguments of OSS for this optimizer (on top of the rule's)
    oss: Mapping[str, Any] = field(default_factory=dict)


def _attr(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def muon():
    return torch.optim.Muon, {"lr": 1e-2}


def po_lion():
    return _attr("pytorch_optimizer", "Lion"), {"lr": 1e-3}


def po_adopt():
    return _attr("pytorch_optimizer", "ADOPT"), {"lr": 1e-3}


def po_shampoo():
    return _attr("pytorch_optimizer", "Shampoo"), {"lr": 1e-3}


def po_lamb():
    return _attr("pytorch_optimizer", "Lamb"), {"lr": 1e-3}


def po_ademamix():
    return _attr("pytorch_optimizer", "AdEMAMix"), {"lr": 1e-3}


def po_adan():
    return _attr("pytorch_optimizer", "Adan"), {"lr": 1e-3}


def po_stable_adamw():
    return _attr("pytorch_optimizer", "StableAdamW"), {"lr": 1e-3}


def po_soap():
    # a preconditioner update at every step, so the eigenbases change within the few steps
    return _attr("pytorch_optimizer", "SOAP"), {"lr": 1e-3, "precondition_frequency": 1}


def po_schedule_free_adamw():
    return _attr("pytorch_optimizer", "ScheduleFreeAdamW"), {"lr": 1e-3}


def lion_pytorch():
    return _attr("lion_pytorch", "Lion"), {"lr": 1e-4}


def sf_adamw():
    return _attr("schedulefree", "AdamWScheduleFree"), {"lr": 1e-3}


def sf_sgd():
    return _attr("schedulefree", "SGDScheduleFree"), {"lr": 1e-2}


def sf_radam():
    return _attr("schedulefree", "RAdamScheduleFree"), {"lr": 1e-3}


def sf_wrapped_sgd(params, **kwargs):
    """schedulefree's ``ScheduleFreeWrapper`` around SGD with momentum 0 (as its docs ask)."""
    wrapper = _attr("schedulefree", "ScheduleFreeWrapper")
    return wrapper(torch.optim.SGD(params, lr=kwargs.pop("lr"), momentum=0), **kwargs)


def sf_wrapper():
    return sf_wrapped_sgd, {"lr": 1e-2}


def heavyball_adamw():
    importlib.import_module("heavyball").utils.compile_mode = None  # eager: the same state
    return _attr("heavyball", "AdamW"), {"lr": 1e-3}


def heavyball_steps(state):
    """heavyball keeps a group's ``step`` in the state of the first param its instance
    holds (under OSS: each rank's first; the plain class loading OSS's dict keeps a stale
    copy where it does not read it): the state without the steps, and the latest step."""
    steps = set()

    def strip(value):
        if isinstance(value, dict):
            if "step" in value:
                steps.add(int(value["step"]))
            return {k: strip(v) for k, v in value.items() if k != "step"}
        return value

    stripped = {i: strip(s) for i, s in state.items()}
    return stripped, max(steps, default=None)


def po_ranger21():
    # extra top-level keys in its state_dict(): current_lr, lookahead_step, starting_lr
    return _attr("pytorch_optimizer", "Ranger21"), {"lr": 1e-3, "num_iterations": 100}


def po_spam():
    # state not keyed by a param (total_step, current_step) and a top-level 'warmup'
    return _attr("pytorch_optimizer", "SPAM"), {"lr": 1e-3}


def po_lookahead_of_adamw(params, **kwargs):
    """pytorch_optimizer's ``Lookahead`` around torch's ``AdamW``, merging every 2 steps (so
    the harness's few steps cross merges): its state_dict() nests AdamW's."""
    lookahead = _attr("pytorch_optimizer", "Lookahead")
    return lookahead(torch.optim.AdamW(params, **kwargs), k=2)


def po_lookahead():
    return po_lookahead_of_adamw, {"lr": 1e-3}


def matrices_model(seed: int = 0) -> torch.nn.Module:
    """A model of matrices only (Muon steps 2-D params only), three of them, so that every
    one of the harness's 3 ranks owns one (torch's DCP ``full_state_dict=True`` load fails on
    a rank that holds no state at all: docs/optimizers.md)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 12, bias=False),
        torch.nn.Tanh(), torch.nn.Linear(12, 4, bias=False),
    )  # fmt: skip


#: What the optimizers with state_dict() extras refuse (tests/state_paths.py's ``refused``).
FLAT_REFUSED = {"dcp-flat-keys": "flatten_optimizer_state_dict=True rebuilds only"}

ZOO: dict[str, Zoo] = {
    "torch-Muon": Zoo("torch.optim.Muon", muon, matrices_only=True),
    "po-Lion": Zoo("pytorch_optimizer", po_lion, elementwise=True),
    "po-ADOPT": Zoo("pytorch_optimizer", po_adopt, elementwise=True),
    "po-Shampoo": Zoo("pytorch_optimizer", po_shampoo),
    "po-Lamb": Zoo("pytorch_optimizer", po_lamb),
    "po-AdEMAMix": Zoo("pytorch_optimizer", po_ademamix, elementwise=True),
    "po-Adan": Zoo("pytorch_optimizer", po_adan, elementwise=True),
    "po-StableAdamW": Zoo("pytorch_optimizer", po_stable_adamw),
    "po-SOAP": Zoo("pytorch_optimizer", po_soap),
    "po-ScheduleFreeAdamW": Zoo("pytorch_optimizer", po_schedule_free_adamw, elementwise=True),
    "lion-pytorch-Lion": Zoo("lion_pytorch", lion_pytorch, elementwise=True),
    "sf-AdamWScheduleFree": Zoo("schedulefree", sf_adamw, elementwise=True),
    "sf-SGDScheduleFree": Zoo("schedulefree", sf_sgd, elementwise=True),
    "sf-RAdamScheduleFree": Zoo("schedulefree", sf_radam, elementwise=True),
    # the wrapper keeps its mode on itself, not in its state_dict(): a resume of a save made
    # in train mode moves the params again, the plain wrapper's as OSS's (docs/optimizers.md);
    # its mode switches and round trips from eval mode are tests/test_modes.py's
    "sf-ScheduleFreeWrapper": Zoo("schedulefree", sf_wrapper, paths=False),
    # elementwise when eager, but compiled per shape by default: not declared
    "heavyball-AdamW": Zoo("heavyball", heavyball_adamw, normalize=heavyball_steps),
    # what their state_dict() holds beyond per-param state and param groups (issue 54)
    # torch's flatten_optimizer_state_dict=True rebuilds only the live groups' and state's
    # keys: refused with the reason (docs/optimizers.md)
    # Ranger21 reads across params (its stable weight decay divides by the variance over every
    # param: refused by the probe; one instance and two over halves part after about a hundred
    # steps, tests/test_zoo_sweep.py's reference): its state paths run with the drift accepted,
    # over too few steps for it to move a value
    "po-Ranger21": Zoo(
        "pytorch_optimizer",
        po_ranger21,
        refused=FLAT_REFUSED,
        all_rules=False,
        oss={"allow_cross_param": True},
    ),
    "po-SPAM": Zoo("pytorch_optimizer", po_spam, refused=FLAT_REFUSED, all_rules=False),
    "po-Lookahead(AdamW)": Zoo(
        "pytorch_optimizer", po_lookahead, refused=FLAT_REFUSED, all_rules=False
    ),
}


def available(need: str | None) -> bool:
    if need is None:
        return True
    if need.startswith("torch.optim."):
        return hasattr(torch.optim, need.rsplit(".", 1)[-1])
    return importlib.util.find_spec(need) is not None


def params(names=None, elementwise=None, paths=None):
    """pytest params of the zoo's names (skipped when the package is missing)."""
    return [
        pytest.param(
            name,
            id=name,
            marks=pytest.mark.skipif(not available(z.need), reason=f"{z.need} is not installed"),
        )
        for name, z in ZOO.items()
        if (names is None or name in names)
        and (elementwise is None or z.elementwise == elementwise)
        and (paths is None or z.paths == paths)
    ]


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """heavyball compiles its step (minutes on this CPU): run it eagerly, the same math."""
    with torch.compiler.set_stance("force_eager"):
        yield
