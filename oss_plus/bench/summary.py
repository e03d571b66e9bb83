"""The step benchmark's summary: how oss_plus compares with its peers on this machine.

A table within :data:`WIDTH` columns: time per step, optimizer state per rank and peak RSS per
rank, each next to its ratio to oss_plus's (the row's figure over oss_plus's, in every column),
then a few lines that say what the figures are. Every other figure is in the JSON
(:func:`oss_plus.bench.report.to_json`) and in ``--details``'s table
(:func:`oss_plus.bench.report.table`).
"""

from __future__ import annotations

from typing import Any

from oss_plus.bench.impls import IMPLS
from oss_plus.bench.step_bench import BenchResult

#: The widest line the summary prints.
WIDTH = 100
#: The row every ratio divides by (the first row when it did not run).
ANCHOR = "oss_plus"
MB = 2**20
_LABEL = 32
_CELLS = (9, 11)  # a figure, its ratio
_GROUPS = ("time per step", "state per rank", "peak RSS per rank")


def _anchor(result: BenchResult) -> str:
    return ANCHOR if ANCHOR in result.rows else next(iter(result.rows))


def _figures(row: dict[str, Any]) -> list[float | None]:
    """Time per step (ms), state on the most loaded rank (MiB), peak RSS (MiB) or None."""
    rss = max(r["peak"] for r in row["rss"]) / MB if row.get("rss") else None
    return [row["step_s"] * 1e3, max(row["state_bytes"]) / MB, rss]


def _number(value: float) -> str:
    """Three significant digits or one decimal, whichever is longer: 51.5, 1.23, 0.0456."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _cells(figures: list[float | None], anchor: list[float | None]) -> list[str]:
    cells = []
    for value, base in zip(figures, anchor):
        ratio = value / base if value is not None and base else None
        cells.append("-" if value is None else _number(value))
        cells.append("-" if ratio is None else f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}")
    return cells


def _line(label: str, cells: list[str]) -> str:
    out = label[:_LABEL].ljust(_LABEL)
    for i, cell in enumerate(cells):
        out += cell.rjust(_CELLS[i % 2])
    return out.rstrip()


def summary_table(result: BenchResult, json_path: str = "") -> str:
    """Return the summary: the table and a few lines of what it means.

    Every line is at most :data:`WIDTH` characters long.
    """
    cfg, machine, rows = result.config, result.machine, result.rows
    anchor_key = _anchor(result)
    anchor_label = IMPLS[anchor_key].label
    model = (
        f"{cfg['tensors']} equal tensors"
        if cfg.get("tensors")
        else f"Linear({cfg['width']}, {cfg['width']}) layers"
    )
    lines = [
        f"oss_plus bench: {cfg['size']:g}M params ({model}), {cfg['optimizer']}, "
        f"{cfg['world_size']} rank{'s' * (cfg['world_size'] != 1)} on {machine['backend']}, "
        f"{machine['cores']} cores",
        f"x {anchor_key}: the row's figure over {anchor_label}'s (above 1: more than it)",
        "",
        " " * _LABEL + "".join(h.rjust(sum(_CELLS)) for h in _GROUPS),
        _line(
            "implementation",
            [unit for u in ("ms", "MiB", "MiB") for unit in (u, f"x {anchor_key}")],
        ),
    ]
    base = _figures(rows[anchor_key])
    lines += [_line(IMPLS[key].label, _cells(_figures(row), base)) for key, row in rows.items()]
    lines += [""] + _meaning(result)
    lines += [f"skipped {IMPLS[k].label}: {reason}" for k, reason in result.skipped.items()]
    if json_path:
        lines.append(f"every other figure (wire bytes, CPU time, clip, each step): {json_path}")
    return "\n".join(_wrap(line) for line in lines)


def _meaning(result: BenchResult) -> list[str]:
    """What the columns are, in a few lines."""
    cfg, rows = result.config, result.rows
    lines = [
        f"time per step: the optimizer step alone (grads set once), median over {cfg['rounds']} "
        f"x {cfg['steps']} steps, slowest rank",
        "state per rank: optimizer-state bytes on the most loaded rank",
        "peak RSS: that rank's peak resident memory in fresh ranks (torch, model, grads, state;"
        " -: not measured)",
    ]
    if "unsharded" in rows:
        lines.append("unsharded optimizer: every rank holds all the state and sends nothing")
    if "floor" in rows:
        lines.append(
            "shard floor: each rank steps its own shard and sends nothing (no sharded "
            "step is faster)"
        )
    return lines


def _wrap(line: str) -> str:
    """``line`` cut into lines of at most :data:`WIDTH` characters at spaces."""
    if len(line) <= WIDTH:
        return line
    out, current = [], ""
    for word in line.split(" "):
        if current and len(current) + 1 + len(word) > WIDTH:
            out.append(current)
            current = "  " + word
        else:
            current = f"{current} {word}" if current else word
    return "\n".join([*out, current])
