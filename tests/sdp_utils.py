"""Helpers for the ShardedDataParallel tests (imported inside pool workers too).

The reference everywhere is torch's DistributedDataParallel + oss_plus.OSS: the same model,
data and optimizer, with gradients all-reduced by DDP instead of reduced to their owner.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel

#: Bucket sizes every behaviour is checked with: one param per bucket, small, fairscale's.
BUCKETS = [0, 64, 2**23]


class Net(torch.nn.Module):
    """An MLP with an optional branch (unused params) and an optional BatchNorm (buffers)."""

    def __init__(self, width: int = 8, branch: bool = False, norm: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width + 4)
        self.norm = torch.nn.BatchNorm1d(width + 4) if norm else None
        self.fc2 = torch.nn.Linear(width + 4, width + 2)
        self.head = torch.nn.Linear(width + 2, 1)
        self.branch = torch.nn.Linear(width + 2, 1) if branch else None
        self.never = torch.nn.Linear(3, 3) if branch else None  # used on no rank, ever

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.norm is not None:
            h = self.norm(h)
        h = torch.tanh(self.fc2(h))
        out = self.head(h)
        if use_branch and self.branch is not None:
            out = out + self.branch(h)
        return out


def batch(step: int, rank: int, width: int = 8) -> torch.Tensor:
    """A different batch on every rank and step (so the reduction matters)."""
    return torch.randn(6, width, generator=torch.Generator().manual_seed(1000 * rank + step))


def pair(
    ctx: Any,
    bucket: int,
    optim: type[torch.optim.Optimizer] = torch.optim.Adam,
    net: dict[str, Any] | None = None,
    ddp: dict[str, Any] | None = None,
    **sdp: Any,
) -> tuple[Any, OSS, Any, OSS]:
    """(SDP, its OSS, DDP, its OSS) over identical copies of one model, on ``ctx.group``."""
    torch.manual_seed(0)
    model = Net(**(net or {}))
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=optim, group=ctx.group, lr=0.01)
    wrapped = ShardedDataParallel(model, opt, ctx.group, reduce_buffer_size=bucket, **sdp)
    ref_opt = OSS(ref.parameters(), optim=optim, group=ctx.group, lr=0.01)
    reference = DDP(ref, process_group=ctx.group, **(ddp or {}))
    return wrapped, opt, reference, ref_opt


def abs_sum(ctx: Any, module: torch.nn.Module, loss_fn: Any) -> list[torch.Tensor | None]:
    """Per param, sum over ranks of |local grad| / world_size (a copy of ``module`` is used).

    Any summation order of the per-rank terms ``g_r / world_size`` is within
    ``(world_size - 1) * eps/2 * abs_sum`` of the exact sum, so two orders are within
    ``(world_size - 1) * eps * abs_sum`` of each other.
    """
    local = copy.deepcopy(module)
    for p in local.parameters():
        p.grad = None
    loss_fn(local).backward()
    sums: list[torch.Tensor | None] = []
    for p in local.parameters():  # every rank reduces every param, used locally or not
        term = (p.grad if p.grad is not None else torch.zeros_like(p)).abs() / ctx.world_size
        dist.all_reduce(term, group=ctx.group)
        sums.append(term)
    return sums


def grads_match(
    ctx: Any, sdp: Any, opt: OSS, ddp: Any, sums: list[torch.Tensor | None] | None = None
) -> dict[str, Any]:
    """Compare SDP's grads with DDP's: owners only, bit-identical, or within the bound.

    Returns ``sharded`` (a rank holds a grad exactly for the params it owns, among those DDP
    gave a grad), ``exact`` (bit-identical) and ``within`` (within the summation-order bound
    of :func:`abs_sum`, when ``sums`` is given).
    """
    sharded, exact, within = True, True, True
    params = zip(sdp.module.parameters(), ddp.module.parameters(), sums or [])
    for p, q in zip(sdp.module.parameters(), ddp.module.parameters()):
        owns = opt.param_to_rank[p] == ctx.rank
        if (p.grad is not None) != (owns and q.grad is not None):
            sharded = False
        if p.grad is not None and q.grad is not None:
            exact &= torch.equal(p.grad, q.grad)
    for p, q, s in params:
        if p.grad is not None and q.grad is not None and s is not None:
            bound = (ctx.world_size - 1) * torch.finfo(s.dtype).eps * s
            within &= bool(((p.grad - q.grad).abs() <= bound).all())
    return {"sharded": sharded, "exact": exact, "within": within}


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def same_everywhere(ctx: Any, tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is bit-identical on every rank of the group."""
    gathered = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, tensor, group=ctx.group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _device_type(x: Any) -> str | None:
    if isinstance(x, torch.Tensor):
        return x.device.type
    return torch.device(x).type if x is not None else None


def _to_host(name: str, args: Any, kwargs: Any) -> bool:
    """Whether a copy op moves values from a device to the CPU."""
    if name.endswith("_to_copy"):
        src, dst = args[0], (kwargs or {}).get("device")
    else:
        dst, src = args[0], args[1]
    return _device_type(src) not in ("cpu", None) and _device_type(dst) == "cpu"


class HostReads:
    """Counts reads of tensor values on the host (each one a device sync on CUDA).

    Counted: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``)
    and copies from a non-CPU device to the CPU, seen by a ``TorchDispatchMode``; and calls
    of ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu``, which on a CPU tensor reach no
    kernel, so they are counted by patching the methods. ``reads`` lists what was seen.
    """

    _METHODS = ("tolist", "numpy", "cpu")

    def __init__(self) -> None:
        self.reads: list[str] = []
        self._saved: dict[str, Any] = {}
        self._mode: Any = None

    def __enter__(self) -> HostReads:
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self.reads

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                name = str(func.overloadpacket)
                scalar = name.endswith("_local_scalar_dense")
                if scalar or (
                    name.endswith(("_to_copy", "copy_")) and _to_host(name, args, kwargs)
                ):
                    reads.append(name)
                return func(*args, **(kwargs or {}))

        for method in self._METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(t, *a, _name=method, _original=original, **k):  # noqa: ANN001
                reads.append(_name)
                return _original(t, *a, **k)

            setattr(torch.Tensor, method, counted)
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
