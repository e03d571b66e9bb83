"""Helpers shared by the multi-process tests (imported inside pool workers too)."""

from __future__ import annotations

from typing import Any

import torch

#: The process-group configurations every distributed behaviour is checked on.
WORLDS = [
    {"world_size": 1},
    {"world_size": 2},
    {"world_size": 3},
    {"world_size": 4},
    {"ranks": (2, 3)},
]
WORLD_IDS = ["ws1", "ws2", "ws3", "ws4", "offset23"]


def make_model(seed: int = 0, width: int = 6, depth: int = 3) -> torch.nn.Module:
    """A small MLP with params of different sizes, identical for a given seed."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    sizes = [width + 2 * i for i in range(depth + 1)]
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(sizes[-1], 1))
    return torch.nn.Sequential(*layers)


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def batch(step: int, width: int = 6, n: int = 5) -> torch.Tensor:
    """The same batch on every rank for a given step (so grads agree without DDP)."""
    return torch.randn(n, width, generator=torch.Generator().manual_seed(100 + step))


def backward(model: torch.nn.Module, step: int) -> torch.Tensor:
    loss = model(batch(step)).pow(2).mean()
    loss.backward()
    return loss


def train(model: torch.nn.Module, opt: Any, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def state_equal(a: dict, b: dict) -> bool:
    """Exact equality of two torch.optim state dicts (tensors, values and groups)."""
    if sorted(a["state"]) != sorted(b["state"]) or a["param_groups"] != b["param_groups"]:
        return False
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        if sorted(sa) != sorted(sb):
            return False
        for key in sa:
            x, y = sa[key], sb[key]
            if isinstance(x, torch.Tensor):
                if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                    return False
            elif x != y:
                return False
    return True


def catch(fn, *args, **kwargs):
    """Run fn and return (exception type name, message) or ('ok', result).

    Lets a pool task return an error as data, so a test can assert that every rank raised.
    """
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc))
