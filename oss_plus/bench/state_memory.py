"""Optimizer-state bytes per rank: low-bit optimizers (torchao, bitsandbytes) under ``OSS``,
next to ``torch.optim.AdamW`` under ``OSS`` and both unsharded (``oss-plus bench
--state-memory``).

The model is transformer-like (:func:`build_model`): an embedding, blocks of LayerNorm +
Linear(d, 3d) + Linear(d, d) + LayerNorm + Linear(d, 4d) + Linear(4d, d), a final LayerNorm
and an untied head; its biases and norms are under the 4096 elements below which the low-bit
optimizers keep fp32 state, and the table shows what they cost. Each world size runs in
freshly spawned gloo ranks; every rank sets random gradients, takes one ``OSS`` step (so the
inner optimizer creates its state) and counts its inner optimizer's state
(:func:`oss_plus.bench.state_count.count_state`: the distinct storages of the state's plain
tensors, tensor subclasses taken apart). The unsharded rows run in this process.

The ``planned`` column is :mod:`oss_plus.planning.optim_state`'s table summed over the
tensors each rank owns under ``OSS``'s default rule: what ``oss-plus plan --optimizer``
projects, next to what the optimizer holds.

torchao compiles its step per tensor shape (minutes on a small CPU); ``TORCHDYNAMO_DISABLE=1``
runs it eagerly, with the same state.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from oss_plus.bench.state_count import StateCount, count_state
from oss_plus.planning.optim_state import OPTIMIZER_STATES
from oss_plus.planning.partition import ParamSpec
from oss_plus.planning.scale import rank_numels
from oss_plus.runtime.launch import run_local

#: Rows: name (as ``oss-plus plan --optimizer``) -> (module, class, keyword arguments).
OPTIMIZERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "adam": ("torch.optim", "Adam", {}),
    "adamw": ("torch.optim", "AdamW", {}),
    "sgd": ("torch.optim", "SGD", {"momentum": 0.9}),
    "adamw8bit": ("torchao.optim", "AdamW8bit", {}),
    "adamw4bit": ("torchao.optim", "AdamW4bit", {}),
    "adamwfp8": ("torchao.optim", "AdamWFp8", {}),
    "bnb-adam8bit": ("bitsandbytes.optim", "Adam8bit", {}),
    "bnb-adamw8bit": ("bitsandbytes.optim", "AdamW8bit", {}),
}
DEFAULT_OPTIMIZERS = ("adamw", "adamw8bit", "bnb-adamw8bit")
DEFAULT_WORLDS = (2, 4)
DEFAULT_WIDTH = 256
#: The row every other is compared with at the same world size.
BASELINE = "adamw"
#: Transformer blocks of the model.
BLOCKS = 4
KIB, MIB = 2**10, 2**20


def build_model(width: int, blocks: int = BLOCKS) -> torch.nn.Sequential:
    """The transformer-like model of the module doc (vocabulary ``16 * width``)."""
    torch.manual_seed(0)
    d = width
    layers: list[torch.nn.Module] = [torch.nn.Embedding(16 * width, width)]
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)]
        layers += [torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)]
    layers += [torch.nn.LayerNorm(d), torch.nn.Linear(d, 16 * width, bias=False)]
    return torch.nn.Sequential(*layers)


def missing(name: str) -> str | None:
    """Why row ``name`` cannot run here (its package is not installed), or None."""
    package = OPTIMIZERS[name][0].split(".")[0]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install {package})"
    return None


def _stepped(name: str, width: int, sharded: bool) -> StateCount:
    """Build row ``name`` over a fresh model, step once on random grads, count its state."""
    module, cls_name, kwargs = OPTIMIZERS[name]
    cls = getattr(importlib.import_module(module), cls_name)
    model = build_model(width)
    if sharded:
        from oss_plus import OSS

        opt: Any = OSS(model.parameters(), optim=cls, lr=1e-3, **kwargs)
    else:
        opt = cls(model.parameters(), lr=1e-3, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return count_state(opt.optim if sharded else opt)


def _rank(rank: int, world: int, names: tuple[str, ...], width: int) -> list[dict[str, Any]]:
    return [asdict(_stepped(name, width, sharded=True)) for name in names]


def planned(name: str, width: int, world: int) -> list[int]:
    """Per rank, the state bytes the planning table gives row ``name`` (``world`` 1:
    unsharded)."""
    specs = [ParamSpec(p.numel()) for p in build_model(width).parameters()]
    layout = OPTIMIZER_STATES[name]
    return [layout.rank_bytes(n) for n in rank_numels(specs, world, "fairscale")]


def measure(
    names: tuple[str, ...], worlds: tuple[int, ...], width: int
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every row at world 1 (unsharded, in this process) and under ``OSS`` at ``worlds``.

    Returns:
        The rows (optimizer, world, per-rank counts and planned bytes) and the skipped
        optimizers with the reason.
    """
    skipped = {n: why for n in names if (why := missing(n))}
    names = tuple(n for n in names if n not in skipped)
    rows = []
    for name in names:  # unsharded: in this process
        rows.append(_row(name, 1, [asdict(_stepped(name, width, sharded=False))], width))
    for world in worlds:
        ranks = run_local(_rank, world, names, width)
        rows += [_row(n, world, [r[i] for r in ranks], width) for i, n in enumerate(names)]
    return rows, skipped


def _row(name: str, world: int, counts: list[dict[str, Any]], width: int) -> dict[str, Any]:
    return {
        "optimizer": name,
        "world": world,
        "ranks": counts,
        "planned": planned(name, width, world),
    }


def table(rows: list[dict[str, Any]], skipped: dict[str, str], width: int) -> str:
    """The rows as text, one line each, with the ratios and the skipped rows."""
    model = build_model(width)
    numels = [p.numel() for p in model.parameters()]
    small = [n for n in numels if n < 4096]
    head = (
        f"optimizer state per rank: transformer-like model (width {width}, {BLOCKS} blocks, "
        f"vocabulary {16 * width}), {sum(numels):,} params in {len(numels)} tensors, "
        f"{len(small)} of them under 4096 elements ({sum(small):,} elements); one step on "
        "random grads; OSS's default rule (fairscale)"
    )
    base = {r["world"]: _most(r) for r in rows if r["optimizer"] == BASELINE}
    alone = {r["optimizer"]: _most(r) for r in rows if r["world"] == 1}
    cols = [f"{'optimizer':<14}", f"{'ranks':>5}{'':9}", "MiB/rank", "x adamw", "x unsharded"]
    cols += ["planned", "per rank MiB", "fp32-state tensors (elements, KiB) on the largest rank"]
    lines = [head, "", "  ".join(cols)]
    for r in rows:
        most, plan = _most(r), max(r["planned"])
        top = max(r["ranks"], key=lambda c: c["total"])
        exact = "exact" if r["planned"] == [c["total"] for c in r["ranks"]] else f"{plan / MIB:.3f}"
        per_rank = ",".join(f"{c['total'] / MIB:.2f}" for c in r["ranks"])
        cells = [
            f"{r['optimizer']:<14}",
            f"{r['world']:>5}" + (" (no OSS)" if r["world"] == 1 else " " * 9),
            f"{most / MIB:>8.3f}",
            f"{most / base[r['world']]:>7.3f}" if r["world"] in base else f"{'-':>7}",
            f"{most / alone[r['optimizer']]:>11.3f}",
            f"{exact:>7}",
            f"{per_rank:<12}",
            f"{top['full']} ({top['full_numel']:,}, {top['full_bytes'] / KIB:.1f})",
        ]
        lines.append("  ".join(cells))
    lines.append(
        "MiB/rank: the largest rank's state (distinct storages); planned: oss_plus.planning's "
        "table for the same tensors (exact: equal on every rank)"
    )
    lines += [f"skipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def _most(row: dict[str, Any]) -> int:
    return max(c["total"] for c in row["ranks"])


def report(names: tuple[str, ...], worlds: tuple[int, ...], width: int, out: Path) -> int:
    """Measure, print the table, write ``out`` (JSON). Returns the exit code."""
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        raise ValueError(
            f"unknown --impls {unknown} for --state-memory: choose from {list(OPTIMIZERS)}"
        )
    if not worlds or min(worlds) < 1 or width < 1:
        raise ValueError(
            f"--state-memory needs world sizes >= 1 and --width >= 1, got {worlds}, {width}"
        )
    rows, skipped = measure(names, worlds, width)
    print(table(rows, skipped, width))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"width": width, "rows": rows, "skipped": skipped}, indent=2) + "\n")
    print(f"results: {out}")
    return 0


def main_from_args(args: argparse.Namespace) -> int:
    """``oss-plus bench --state-memory``: ``--impls`` the optimizers (default
    :data:`DEFAULT_OPTIMIZERS`), ``--sweep-worlds`` the world sizes (default 2,4), ``--width``
    the model's width; ``state_memory.json`` under ``--out``.

    Raises:
        ValueError: an unknown optimizer, a world size or width below 1.
    """
    names = tuple(x.strip() for x in (args.impls or "").split(",") if x.strip())
    worlds = tuple(int(x) for x in (args.sweep_worlds or "").split(",") if x.strip())
    width = args.width or DEFAULT_WIDTH
    out = Path(args.out) / "state_memory.json"
    return report(names or DEFAULT_OPTIMIZERS, worlds or DEFAULT_WORLDS, width, out)
