"""Helpers shared by the differential suites (imported inside pool workers too)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: Process-group configurations every differential scenario runs on.
WORLDS = [
    {"world_size": 1},
    {"world_size": 2},
    {"world_size": 3},
    {"world_size": 4},
    {"ranks": (2, 3)},
]
WORLD_IDS = ["ws1", "ws2", "ws3", "ws4", "offset23"]

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def make_model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    """A small MLP (matmuls, so the memory layout of params matters for rounding)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width + 4),
        torch.nn.Tanh(),
        torch.nn.Linear(width + 4, width + 2),
        torch.nn.Tanh(),
        torch.nn.Linear(width + 2, 1),
    )


def clones(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    return [copy.deepcopy(model) for _ in range(n)]


def groups_of(model: torch.nn.Module, two_groups: bool = True) -> list[dict[str, Any]]:
    """Two param groups with different learning rates (or one group)."""
    params = list(model.parameters())
    if not two_groups:
        return [{"params": params}]
    return [{"params": params[::2]}, {"params": params[1::2], "lr": 0.003}]


def batch(step: int, width: int = 8, rank: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 100 + step)
    return torch.randn(6, width, generator=gen)


def loss_of(model: torch.nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    return model(batch(step, rank=rank)).pow(2).mean()


def train(
    model: torch.nn.Module,
    opt: Any,
    steps: int,
    start: int = 0,
    scheduler: Any = None,
    use_closure: bool = False,
) -> list[float]:
    """Plain training loop; optionally with a closure (odd steps) and an LR scheduler."""
    losses = []
    for step in range(start, start + steps):
        if use_closure and step % 2:

            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = loss_of(model, step)
                loss.backward()
                return loss

            losses.append(float(opt.step(closure)))
        else:
            opt.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        if scheduler is not None:
            scheduler.step()
    return losses


def flat(params: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def flat_model(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def index_of(model_params: list[torch.Tensor]) -> Callable[[torch.Tensor], int]:
    ids = {id(p): i for i, p in enumerate(model_params)}
    return lambda p: ids[id(p)]


def partition_indices(opt: Any, params: list[torch.Tensor], method: str) -> list[list[list[int]]]:
    """Per rank, per group, the indices (in ``params``) of the params the rank owns."""
    idx = index_of(params)
    return [[[idx(p) for p in g["params"]] for g in groups] for groups in getattr(opt, method)()]


def same_value(a: Any, b: Any) -> bool:
    """Exact, dtype-sensitive equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def catch(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """Run ``fn``; return ("ok", result) or (exception type name, message)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc))


def caught(ctx: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """Pool task: run ``fn(ctx, *args, **kwargs)`` and return :func:`catch`'s result."""
    return catch(fn, ctx, *args, **kwargs)


def load_flat(model: torch.nn.Module, values: torch.Tensor) -> None:
    """Copy ``values`` (as from :func:`flat_model`) into the params of ``model``."""
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(values[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class KwargSGD(torch.optim.SGD):
    """An optimizer whose step takes an extra keyword (as apex's fused optimizers do)."""

    def step(self, closure=None, scale=1.0):
        for group in self.param_groups:
            group["seen_scale"] = scale
        return super().step(closure)
