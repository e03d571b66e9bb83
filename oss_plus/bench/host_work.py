"""Host work per iteration of ZeRO-2 against DDP + ``OSS``, counted (not timed).

    python -m oss_plus.bench.host_work [--world 2] [--layers 96] [--configs ...]

Where no GPU is at hand, the host work of an iteration is what can be compared with DDP's
without timing noise. For each configuration (the ``oss-plus bench --zero2`` rows, on the
CPU proxy: ``--layers`` x (Linear(64, 64) + LayerNorm + Tanh), batch 8, Adam ``fused=True``;
``--width`` changes the 64)
one iteration after three warm-up ones is counted on every rank:

* ``fwd_lines``: Python lines executed inside the wrapper's ``forward`` beyond the bare
  module's (``sys.settrace``): the wrapper's own per-forward Python work (a Python loop
  over the params shows here; a C-level pass such as ``list(map(f, params))`` does not);
* ``bwd_calls`` / ``bwd_lines``: Python function calls and lines during ``backward()``:
  hooks and what they call (DDP's reducer runs in C++, so its counts are those of
  ``backward()``'s own Python wrapper);
* ``comms``: collectives launched during ``backward()`` (the process group's profiler
  records, which see DDP's C++ launches too);
* ``ops``: ATen operators dispatched by the whole iteration (zero_grad, forward, backward,
  step; top-level profiler records: on a GPU each is at least one kernel launch);
* ``allocs``: tensor allocations of the whole iteration (profiler memory records), and
  ``peak_mb``: the peak of the bytes allocated during it above what was allocated at its
  start (activations, gradients, reduce buffers, the step's temporaries).

The counts are deterministic for a given torch version and configuration.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.bench.zero2 import _model, _wrap
from oss_plus.runtime.launch import run_local

CONFIGS = (
    "ddp_oss",
    "oss_plus_sdp",
    "oss_plus_sdp_no_unused",
    "oss_plus_sdp_flat",
    "fairscale_sdp",
)
COLUMNS = ("fwd_lines", "bwd_calls", "bwd_lines", "comms", "ops", "allocs", "peak_mb")
_COMM_PREFIXES = ("gloo:", "nccl:", "record_param_comms")
_BACKWARD = "oss_plus_bench::backward"


def python_work(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """Run ``fn``; return the Python function calls and the Python lines it executed (a
    per-param Python loop shows in the lines), and its result."""
    calls, lines = [0], [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            calls[0] += 1
        elif event == "line":
            lines[0] += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        out = fn()
    finally:
        sys.settrace(previous)
    return calls[0], lines[0], out


def _walk(nodes: list[Any], inside_aten: bool, out: dict[str, list[Any]]) -> None:
    for node in nodes:
        name = node.name
        if node.typed[0].name == "Allocation":
            out["memory"].append(node)
        elif name.startswith("aten::") and not inside_aten:
            out["ops"].append(node)
        elif name.startswith(_COMM_PREFIXES):
            out["comms"].append(node)
        elif name == _BACKWARD:
            out["backward"].append(node)
        _walk(node.children, inside_aten or name.startswith("aten::"), out)


def profile_counts(prof: Any) -> dict[str, float]:
    """ops, allocs, peak_mb of a whole iteration; comms inside its backward record."""
    found: dict[str, list[Any]] = {"memory": [], "ops": [], "comms": [], "backward": []}
    _walk(prof.profiler.kineto_results.experimental_event_tree(), False, found)
    backward = found["backward"][:1]
    start, end = (backward[0].start_time_ns, backward[0].end_time_ns) if backward else (0, 0)
    comms = sum(1 for e in found["comms"] if start <= e.start_time_ns <= end)
    total = peak = allocs = 0
    for event in sorted(found["memory"], key=lambda e: e.start_time_ns):
        size = event.typed[1].alloc_size
        allocs += size > 0
        total += size
        peak = max(peak, total)
    return {"comms": comms, "ops": len(found["ops"]), "allocs": allocs, "peak_mb": peak / 2**20}


def _iteration(net: Any, opt: Any, x: torch.Tensor) -> None:
    opt.zero_grad()
    loss = net(x).pow(2).mean()
    with torch.profiler.record_function(_BACKWARD):
        loss.backward()
    opt.step()


def count_config(config: str, layers: int, rank: int, width: int = 64) -> dict[str, float]:
    """The counts of one configuration on this rank (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
    model = _model(width, layers, deep=True)
    net, opt = _wrap(config, model, 2**23, fused=True)
    for _ in range(3):
        _iteration(net, opt, x)
    opt.zero_grad()
    _, bare, _ = python_work(lambda: model(x))
    _, wrapped, out = python_work(lambda: net(x))
    loss = out.pow(2).mean()
    calls, lines, _ = python_work(loss.backward)
    opt.step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _iteration(net, opt, x)
    counts = {"fwd_lines": wrapped - bare, "bwd_calls": calls, "bwd_lines": lines}
    return {**counts, **profile_counts(prof)}


def _rank(
    rank: int, world: int, configs: list[str], layers: int, width: int
) -> dict[str, dict[str, float]]:
    return {c: count_config(c, layers, rank, width) for c in configs}


def main(argv: list[str] | None = None) -> int:
    """Print the counts of every configuration, per rank."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    results = run_local(_rank, args.world, configs, args.layers, args.width, threads=1)
    w = args.width
    print(
        f"host work per iteration, {args.layers} x (Linear({w}, {w}) + LayerNorm + Tanh), "
        f"{4 * args.layers} params, {args.world} gloo rank(s)"
    )
    print(f"{'config':>24} {'rank':>4} " + " ".join(f"{c:>9}" for c in COLUMNS))
    for rank, result in enumerate(results):
        for config in configs:
            row = result[config]
            cells = " ".join(
                f"{row[c]:>9.2f}" if c == "peak_mb" else f"{int(row[c]):>9}" for c in COLUMNS
            )
            print(f"{config:>24} {rank:>4} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
