"""State that ``torch.save`` carries, through every state path of OSS (issue 49): sets and
frozensets, keys other than strings in nested per-param state, each tensor's strides and,
within a state value, its storage sharing and offset (:mod:`oss_plus.state.layout`).

The optimizers: pytorch_optimizer's ``SOAP`` (its eigenbases ``Q`` are transposed views),
heavyball's ``AdamW`` (each param's state nested under ``0``, ``is_initialized`` sets) and
:class:`LayoutSGD`, hand-built to hold all of it at once, with a step that reads it (a
view that lost its storage sharing would change the run). Each runs through every path of
:mod:`state_paths` (one pool task at 3 ranks) against ``torch.save`` of the unsharded
optimizer's state and against its run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from state_paths import Case, every_path_task, expected_paths


class LayoutSGD(torch.optim.Optimizer):
    """SGD with momentum whose state holds what ``torch.save`` carries and JSON does not: a
    transposed view (2-D params) or a strided slice (1-D), two tensors sharing a storage,
    a set, a frozenset and keys that are an int, a tuple, None and a float."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    flipped = torch.zeros(tuple(reversed(p.shape))).t()
                    state["buf"] = flipped if p.dim() == 2 else torch.zeros(2 * n)[::2]
                    whole = torch.zeros(2 * n)
                    state["pair"] = (whole, whole[1::2])
                    state[0] = {
                        "seen": set(),
                        (1, "a"): frozenset({2, (3, 4)}),
                        None: True,
                        2.5: None,
                    }
                seen = state[0]["seen"]
                seen.add(len(seen))
                state["buf"].mul_(0.9).add_(p.grad)
                whole, odd = state["pair"]
                whole.mul_(0.5).add_(p.grad.reshape(-1).repeat(2))  # odd follows: a view
                update = state["buf"] + 0.1 * odd.reshape(p.shape)
                p.sub_(group["lr"] * update / len(seen))


def _layout_sgd():
    return LayoutSGD, {"lr": 0.1}


def _soap():
    import pytorch_optimizer

    return pytorch_optimizer.SOAP, {"lr": 1e-2, "precondition_frequency": 1}


def _heavyball_adamw():
    import heavyball

    heavyball.utils.compile_mode = None  # eager: the same state, seconds instead of minutes
    return heavyball.AdamW, {"lr": 1e-2}


def _heavyball_steps(state):
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


#: The cases, with the package each needs.
CASES = {
    "LayoutSGD": (None, Case("LayoutSGD", _layout_sgd)),
    "pytorch_optimizer-SOAP": ("pytorch_optimizer", Case("SOAP", _soap)),
    "heavyball-AdamW": ("heavyball", Case("heavyball-AdamW", _heavyball_adamw, _heavyball_steps)),
}


def _params():
    return [
        pytest.param(
            case,
            id=name,
            marks=pytest.mark.skipif(
                need is not None and importlib.util.find_spec(need) is None,
                reason=f"{need} is not installed",
            ),
        )
        for name, (need, case) in CASES.items()
    ]


@pytest.mark.parametrize("case", _params())
def test_every_state_path_keeps_what_torch_save_keeps(pool, tmp_path, case):
    got = pool.run(every_path_task, case, str(tmp_path), world_size=3, timeout=300)
    assert got == expected_paths()
