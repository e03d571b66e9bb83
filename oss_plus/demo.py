"""The demo: DDP + oss_plus.OSS on local ranks against the unsharded optimizer.

Each rank takes its own GPU under NCCL when there is one per rank, else every rank runs on
the CPU under gloo (and the report's first line says so when some GPUs were too few);
``--device`` overrides (:func:`oss_plus.runtime.launch.choose_device`).

``--amp`` runs the recipe of ``docs/amp.md`` instead: fp16 autocast + ShardedGradScaler +
OSS.clip_grad_norm + a bf16 wire, against DDP + torch.amp.GradScaler + clip_grad_norm_ + Adam.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus.amp.scaler import ShardedGradScaler
from oss_plus.optimizer import OSS
from oss_plus.planning.model_specs import model_specs
from oss_plus.planning.scale import Topology, scale_rows
from oss_plus.runtime.launch import DEVICES, choose_device, run_local

#: The model, ranks per node and ``oss-plus plan`` command of the demo's "where sharding pays"
#: line (Adam's 8 bytes of state per parameter, ZeRO-1 under the flat rule).
PAYS_MODEL, PAYS_RANKS = "llama2-7b", 8
PAYS_COMMAND = f"oss-plus plan --model {PAYS_MODEL} --nodes 1 --per-node {PAYS_RANKS}"
#: The heading of the demo's ratio column: the sharded side's figure over the unsharded one's.
RATIO = "OSS/Adam"
#: Gradient-norm bound, initial loss scale and growth interval of the --amp demo.
AMP_MAX_NORM = 1.0
AMP_INIT_SCALE = 2.0**20
AMP_GROWTH = 5


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
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _rank_device(rank: int, device_type: str) -> torch.device:
    """Rank ``rank``'s device: its own GPU (``run_local`` set it current under NCCL), or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _describe(device: torch.device, group: Any | None = None) -> str:
    """How the report names the ranks, e.g. ``"gloo ranks (cpu)"``."""
    return f"{dist.get_backend(group)} ranks ({device.type})"


def _ddp(module: torch.nn.Module, device: torch.device, group: Any | None = None) -> DDP:
    ids = [device.index] if device.type == "cuda" else None
    return DDP(module.to(device), process_group=group, device_ids=ids)


def _batch(step: int, rank: int, width: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, width, generator=gen).to(device)


def _iteration(model: DDP, opt: Any, x: torch.Tensor) -> tuple[float, float]:
    """One whole training iteration: forward, backward (DDP's gradient all-reduce) and step
    (for OSS: the local shard's step and the parameter sync). Returns (loss, seconds)."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), x[:, :1].sin())
    loss.backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize(x.device)
    seconds = time.perf_counter() - start
    return loss.item(), seconds


def rank_main(
    rank: int,
    world: int,
    steps: int,
    width: int,
    depth: int,
    group: Any | None = None,
    device_type: str = "cpu",
) -> dict[str, Any]:
    """Train DDP + OSS(Adam) and DDP + Adam side by side on one rank; return what it measured:
    losses, whole-iteration times, the bytes of optimizer state this rank holds, and whether
    the parameters ended bit-identical."""
    device = _rank_device(rank, device_type)
    sharded = _ddp(_model(width, depth), device, group)
    plain = _ddp(_model(width, depth), device, group)
    opt = OSS(sharded.parameters(), optim=torch.optim.Adam, group=group, lr=1e-3)
    ref = torch.optim.Adam(plain.parameters(), lr=1e-3)
    log: dict[str, Any] = {"losses": [], "ref_losses": [], "times": [], "ref_times": []}
    for step in range(steps):
        x = _batch(step, rank, width, device)
        # alternating, so that both sides see the same machine load; the reference first: a
        # rank's last collective is then OSS.step's sync, which returns only after gloo let go
        # of its tensors; DDP's own allreduce does not wait for that, and a process exiting
        # right after it can abort (docs/reliability.md, "Process exit")
        for side, model, optimizer in (("ref_", plain, ref), ("", sharded, opt)):
            loss, seconds = _iteration(model, optimizer, x)
            log[f"{side}losses"].append(loss)
            log[f"{side}times"].append(seconds)
    identical = all(torch.equal(a, b) for a, b in zip(sharded.parameters(), plain.parameters()))
    return log | {
        "identical": identical,
        "state": state_bytes(opt.optim),
        "ref_state": state_bytes(ref),
        "params": sum(p.numel() for p in sharded.parameters()),
        "ranks": _describe(device, group),
    }


def _on_ranks(fn: Any, device: str, world_size: int, *args: Any) -> tuple[list[Any], list[str]]:
    """Run ``fn(rank, world, *args, device_type)`` on ``world_size`` local ranks placed by
    :func:`choose_device`; return the results and the note lines (a fallback to the CPU).

    Raises:
        ValueError: an unknown ``device``, or ``"cuda"`` with fewer GPUs than ranks.
    """
    choice = choose_device(device, 0, world_size)
    results = run_local(fn, world_size, *args, choice.device.type, backend=choice.backend)
    return results, [choice.note] if choice.note else []


def run_demo(
    world_size: int = 2, steps: int = 20, width: int = 256, depth: int = 4, device: str = "auto"
) -> str:
    """Train on ``world_size`` local ranks (``device``: see :func:`_on_ranks`); return the
    report of :func:`format_report`."""
    results, notes = _on_ranks(rank_main, device, world_size, steps, width, depth, None)
    return "\n".join([*notes, format_report(results, steps)])


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps a leading digit, e.g. ``"1.01 MiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def iteration_seconds(results: list[dict[str, Any]], key: str = "times") -> float:
    """The median over the steps after the first (the warm-up) of the slowest rank's time."""
    per_step = [max(times) for times in zip(*(r[key] for r in results))]
    return statistics.median(per_step[1:] or per_step)


def pays_line(model: str = PAYS_MODEL, ranks: int = PAYS_RANKS) -> str:
    """Adam's state per rank for ``model`` on one node of ``ranks``, unsharded and under ZeRO-1:
    the figures of :data:`PAYS_COMMAND`'s ``ddp`` and ``zero1`` (flat) rows."""
    rows = scale_rows(model_specs(model), Topology(1, ranks), ["flat"], [])
    state = {row.stage: row.state / 1e9 for row in rows}
    return (
        f"Llama-2 7B's Adam state is {state['ddp']:.2f} GB per rank unsharded, "
        f"{state['zero1']:.2f} GB over {ranks} ranks:"
    )


def _explained(ours: float, theirs: float, r0: dict[str, Any], world: int) -> list[str]:
    """What the table's rows mean, why the time is what it is, and where sharding pays."""
    where = "over gloo on the CPU" if "(cpu)" in r0["ranks"] else "between the GPUs"
    if ours > theirs:
        why = (
            f"OSS takes longer here: at {r0['params']:,} params, stepping 1/{world} of them saves "
            f"a rank less time than the parameter sync costs (one more collective a step, {where})."
        )
    else:
        why = f"OSS takes no longer here: stepping 1/{world} of the params pays for the sync."
    paragraphs = [
        f"{RATIO}: the OSS figure over the Adam figure, in every row (below 1: OSS needs less).",
        "training iteration: forward, backward (DDP's gradient all-reduce) and step (OSS: the "
        "shard's step and the parameter sync), median of the slowest rank after the first "
        f"step. {why}",
        f"optimizer state: bytes of the state tensors this rank's optimizer holds, about 1/{world} "
        "of Adam's. That is where sharding pays, the more the larger the model and the more "
        f"ranks: {pays_line()}",
    ]
    lines = [
        line for text in paragraphs for line in textwrap.wrap(text, 92, subsequent_indent="  ")
    ]
    return [*lines, f"  {PAYS_COMMAND}"]


def _loss_rows(r0: dict[str, Any], steps: int) -> list[str]:
    stride = max(1, steps // 10)
    shown = list(range(0, steps, stride))
    which = (
        f"{shown[0]}-{shown[-1]}" if stride == 1 else f"{shown[0]}, {shown[1]}, ..., {shown[-1]}"
    )
    lines = [
        f"rank 0's loss, steps {which} of {steps}; the last line compares every step on every rank",
        f"{'step':>4}  {'loss (OSS)':>12}  {'loss (Adam)':>12}  same",
    ]
    for i in shown:
        a, b = r0["losses"][i], r0["ref_losses"][i]
        lines.append(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {'yes' if a == b else 'NO'}")
    return lines


def format_report(results: list[dict[str, Any]], steps: int) -> str:
    """Turn the per-rank logs of :func:`rank_main` into the demo's text report."""
    r0, world = results[0], len(results)
    ours, theirs = iteration_seconds(results), iteration_seconds(results, "ref_times")
    lines = [
        f"oss_plus demo: DDP + OSS(Adam) against DDP + Adam on {world} {r0['ranks']}, "
        f"{r0['params']:,} params, {steps} steps",
        "",
        f"{'':<28}{'DDP + OSS(Adam)':>16}{'DDP + Adam':>14}{RATIO:>10}",
        f"{'training iteration':<28}{ours * 1e3:>13.2f} ms{theirs * 1e3:>11.2f} ms"
        f"{ours / theirs:>9.2f}x",
    ]
    for rank, r in enumerate(results):
        share = r["state"] / max(r["ref_state"], 1)
        lines.append(
            f"{f'optimizer state, rank {rank}':<28}{format_bytes(r['state']):>16}"
            f"{format_bytes(r['ref_state']):>14}{share:>9.2f}x"
        )
    lines += ["", *_explained(ours, theirs, r0, world), "", *_loss_rows(r0, steps)]
    same = all(r["identical"] for r in results) and all(
        r["losses"] == r["ref_losses"] for r in results
    )
    lines.append("")
    lines.append(
        "parameters and losses bit-identical to unsharded Adam on every rank: "
        + ("yes" if same else "NO")
    )
    return "\n".join(lines)


def _amp_step(model: DDP, opt: Any, scaler: Any, x: torch.Tensor) -> tuple[float, float, bool]:
    """One step of the AMP recipe; returns (loss, grad norm, skipped)."""
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), x[:, :1].sin())
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if isinstance(opt, OSS):
        norm = opt.clip_grad_norm(AMP_MAX_NORM)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), AMP_MAX_NORM)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return loss.item(), norm.item(), scaler.get_scale() < scale  # a backoff means a skip


def amp_rank_main(
    rank: int,
    world: int,
    steps: int,
    width: int,
    depth: int,
    group: Any | None = None,
    device_type: str = "cpu",
) -> dict[str, Any]:
    """Train the AMP recipe sharded (bf16 wire) and unsharded on one rank; return the log."""
    device = _rank_device(rank, device_type)
    sharded = _ddp(_model(width, depth), device, group)
    plain = _ddp(_model(width, depth), device, group)
    opt = OSS(
        sharded.parameters(),
        optim=torch.optim.Adam,
        group=group,
        lr=1e-3,
        broadcast_dtype=torch.bfloat16,
    )
    ref = torch.optim.Adam(plain.parameters(), lr=1e-3)
    # a high initial scale overflows at first: the scaler backs off (skipping those steps),
    # then grows again every AMP_GROWTH clean steps
    scaler = ShardedGradScaler(device.type, init_scale=AMP_INIT_SCALE, growth_interval=AMP_GROWTH)
    ref_scaler = torch.amp.GradScaler(
        device.type, init_scale=AMP_INIT_SCALE, growth_interval=AMP_GROWTH
    )
    log: dict[str, Any] = {"rows": [], "ref_rows": [], "ranks": _describe(device, group)}
    for step in range(steps):
        x = _batch(step, rank, width, device)
        log["rows"].append(_amp_step(sharded, opt, scaler, x))
        log["ref_rows"].append(_amp_step(plain, ref, ref_scaler, x))
    diffs = [(a - b).abs().max().item() for a, b in zip(sharded.parameters(), plain.parameters())]
    log.update(
        scale=scaler.get_scale(),
        ref_scale=ref_scaler.get_scale(),
        param_diff=max(diffs),
        wire_fp32=opt.sync_buckets.wire_bytes(None),
        wire=opt.sync_buckets.wire_bytes(opt.wire_dtype),
        params=sum(p.numel() for p in sharded.parameters()),
    )
    return log


def format_amp_report(results: list[dict[str, Any]], steps: int) -> str:
    """Turn the per-rank logs of :func:`amp_rank_main` into the demo's text report."""
    r0 = results[0]
    lines = [
        f"oss_plus demo --amp: DDP + fp16 autocast + ShardedGradScaler + OSS(Adam) with "
        f"clip_grad_norm({AMP_MAX_NORM}) and a bf16 wire, on {len(results)} {r0['ranks']}, "
        f"{r0['params']:,} params, {steps} steps; reference: DDP + torch.amp.GradScaler + "
        "clip_grad_norm_ + Adam (unsharded, fp32)",
        "",
        f"{'step':>4}  {'loss (OSS)':>11}  {'loss (ref)':>11}  {'norm (OSS)':>11}  "
        f"{'norm (ref)':>11}  skipped",
    ]
    for i in range(0, steps, max(1, steps // 10)):
        (loss, norm, skip), (rloss, rnorm, rskip) = r0["rows"][i], r0["ref_rows"][i]
        mark = "yes" if skip else "no"
        lines.append(
            f"{i:>4}  {loss:>11.6f}  {rloss:>11.6f}  {norm:>11.4g}  {rnorm:>11.4g}  "
            f"{mark}{'' if skip == rskip else ' (ref differs)'}"
        )
    skipped = [[i for i, row in enumerate(r["rows"]) if row[2]] for r in results]
    ref_skipped = [i for i, row in enumerate(r0["ref_rows"]) if row[2]]
    same = all(s == skipped[0] for s in skipped) and len({r["scale"] for r in results}) == 1
    lines += [
        "",
        f"skipped steps: {skipped[0]} (reference {ref_skipped}); identical on every rank: "
        + ("yes" if same else "NO"),
        f"loss scale: {r0['scale']:g} (reference {r0['ref_scale']:g})",
        f"final loss: {r0['rows'][-1][0]:.6f} vs {r0['ref_rows'][-1][0]:.6f} unsharded; max "
        f"|param - unsharded param|: {max(r['param_diff'] for r in results):.3g} "
        "(bf16 wire rounding)",
        f"wire bytes per step: {r0['wire_fp32'] / 2**20:.3f} MiB fp32 vs {r0['wire'] / 2**20:.3f} "
        f"MiB bf16 ({r0['wire'] / max(r0['wire_fp32'], 1):.0%})",
    ]
    return "\n".join(lines)


def run_amp_demo(
    world_size: int = 2, steps: int = 20, width: int = 256, depth: int = 4, device: str = "auto"
) -> str:
    """The AMP recipe instead: the same ranks, the report of :func:`format_amp_report`."""
    results, notes = _on_ranks(amp_rank_main, device, world_size, steps, width, depth, None)
    return "\n".join([*notes, format_amp_report(results, steps)])


def _run(args: argparse.Namespace) -> int:
    demo = run_amp_demo if args.amp else run_demo
    sizes = {"world_size": args.world_size, "steps": args.steps, "width": args.width}
    print(demo(**sizes, depth=args.depth, device=args.device))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand to the ``oss-plus`` parser."""
    demo = sub.add_parser(
        "demo",
        help="train a small model with DDP + OSS on local ranks and print a report",
        description="Spawn local ranks (one GPU each under NCCL, else gloo on the CPU), train "
        "a small MLP with DDP + oss_plus.OSS(Adam) and "
        "with DDP + plain Adam, and compare the training iteration's time, the optimizer state "
        "each rank holds, and the losses and parameters (bit-identical).",
    )
    demo.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    demo.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    demo.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="auto (a GPU per rank under NCCL when there are enough, else gloo on the CPU), "
        "cpu or cuda",
    )
    demo.add_argument(
        "--amp",
        action="store_true",
        help="fp16 autocast + ShardedGradScaler + clip_grad_norm + bf16 wire (docs/amp.md)",
    )
    demo.set_defaults(func=_run)
