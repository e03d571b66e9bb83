"""The demo: DDP + oss_plus.OSS on local gloo ranks against the unsharded optimizer."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus._launch import run_local
from oss_plus.optimizer import OSS


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Return the bytes of tensor state an optimizer holds."""
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )


def _train(model: DDP, opt: Any, steps: int, width: int, rank: int) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, width, generator=gen)
        y = x[:, :1].sin()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def _rank_main(rank: int, world: int, steps: int, width: int, depth: int) -> dict[str, Any]:
    sharded = DDP(_model(width, depth))
    plain = DDP(_model(width, depth))
    opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-3)
    ref = torch.optim.Adam(plain.parameters(), lr=1e-3)
    losses, times = _train(sharded, opt, steps, width, rank)
    ref_losses, ref_times = _train(plain, ref, steps, width, rank)
    identical = all(torch.equal(a, b) for a, b in zip(sharded.parameters(), plain.parameters()))
    return {
        "losses": losses, "ref_losses": ref_losses, "identical": identical,
        "state": state_bytes(opt.optim), "ref_state": state_bytes(ref),
        "step": statistics.median(times[1:]), "ref_step": statistics.median(ref_times[1:]),
        "params": sum(p.numel() for p in sharded.parameters()),
    }


def run_demo(world_size: int = 2, steps: int = 20, width: int = 256, depth: int = 4) -> str:
    """Train on ``world_size`` local gloo ranks and return the report as text."""
    results = run_local(_rank_main, world_size, steps, width, depth)
    r0 = results[0]
    lines = [
        f"oss_plus demo: DDP + OSS(Adam) on {world_size} gloo ranks, "
        f"{r0['params']:,} params, {steps} steps",
        "",
        f"{'step':>4}  {'loss (OSS)':>12}  {'loss (Adam)':>12}  same",
    ]
    for i in range(0, steps, max(1, steps // 10)):
        a, b = r0["losses"][i], r0["ref_losses"][i]
        lines.append(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {'yes' if a == b else 'NO'}")
    lines.append("")
    for rank, r in enumerate(results):
        lines.append(
            f"rank {rank}: optimizer state {r['state'] / 2**20:.2f} MiB vs {r['ref_state'] / 2**20:.2f} "
            f"MiB unsharded ({r['state'] / max(r['ref_state'], 1):.0%}); step {r['step'] * 1e3:.2f} ms "
            f"vs {r['ref_step'] * 1e3:.2f} ms"
        )
    same = all(r["identical"] for r in results) and all(
        r["losses"] == r["ref_losses"] for r in results)
    lines.append("")
    lines.append("parameters and losses bit-identical to unsharded Adam on every rank: "
                 + ("yes" if same else "NO"))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    print(run_demo(world_size=args.world_size, steps=args.steps, width=args.width, depth=args.depth))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand to the ``oss-plus`` parser."""
    demo = sub.add_parser(
        "demo", help="train a small model with DDP + OSS on local gloo ranks and print a report",
        description="Spawn local gloo ranks, train a small MLP with DDP + oss_plus.OSS(Adam) and "
                    "with DDP + plain Adam, and compare losses, state size and step time.",
    )
    demo.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    demo.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    demo.set_defaults(func=_run)
