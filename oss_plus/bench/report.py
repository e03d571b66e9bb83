"""Turn a :class:`~oss_plus.bench.step_bench.BenchResult` into a table, a JSON file and a plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from oss_plus.bench.impls import IMPLS, PEERS
from oss_plus.bench.step_bench import BenchResult

MB = 2**20
#: Said instead of the plot where matplotlib is missing (oss_plus is not on the package index:
#: the hint works from a source checkout).
NO_PLOT = (
    "no plot: matplotlib is not installed (pip install matplotlib; in a source checkout also "
    'pip install -e ".[docs]")'
)


def ratios(result: BenchResult) -> dict[str, dict[str, float | None]]:
    """Per row: step time over the floor's and the fastest peer's; RSS over the floor's."""
    rows = result.rows
    floor = rows.get("floor", {}).get("step_s")
    peers = [rows[k]["step_s"] for k in PEERS if k in rows]
    best = min(peers) if peers else None
    floor_rss = _rss(rows["floor"], "steady") if "floor" in rows else None
    floor_net = _net(rows["floor"]) if "floor" in rows else None
    out: dict[str, dict[str, float | None]] = {}
    for key, row in rows.items():
        rss, net = _rss(row, "steady"), _net(row)
        out[key] = {
            "vs_floor": row["step_s"] / floor if floor else None,
            "vs_best_peer": row["step_s"] / best if best else None,
            "rss_vs_floor": rss / floor_rss if rss and floor_rss else None,
            "net_rss_vs_floor": net / floor_net if net and floor_net else None,
        }
    fp32 = rows.get("oss_plus", {}).get("step_s")
    for key in ("oss_plus_bf16", "oss_plus_fp16"):
        if key in rows and fp32:
            out[key]["vs_fp32"] = rows[key]["step_s"] / fp32
    return out


def _rss(row: dict[str, Any], which: str) -> int | None:
    """The largest ``which`` RSS over the ranks, or None when memory was not measured."""
    if "rss" not in row:
        return None
    return max(r[which] for r in row["rss"])


def _net(row: dict[str, Any]) -> int | None:
    """The largest steady RSS above the process's own baseline (torch, process group)."""
    if "rss" not in row:
        return None
    return max(r["steady"] - r["base"] for r in row["rss"])


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(result: BenchResult) -> str:
    """Return the side-by-side table as text."""
    cfg, machine = result.config, result.machine
    rel = ratios(result)
    model = (
        f"{cfg['tensors']} equal tensors"
        if cfg.get("tensors")
        else f"Linear({cfg['width']},{cfg['width']}) stack"
    )
    head = (
        f"oss_plus bench: {cfg['size']:g}M params ({model}) on {cfg.get('device', 'auto')}, "
        f"{cfg['optimizer']}, {cfg['world_size']} rank(s) on {machine['backend']}, "
        f"{machine['threads_per_rank']} thread(s)/rank, {machine['cores']} cores, "
        f"{cfg['rounds']} rounds x {cfg['steps']} steps; load "
        f"{machine['load_before'][0]:.1f} -> {machine.get('load_after', [0])[0]:.1f}"
    )
    cols = [
        "implementation",
        "step ms",
        "x floor",
        "x peer",
        "host ms",
        "syncs",
        "dev pk MB",
        "CPU ms",
        "busy",
        "wire MB",
        "state MB",
        "imbal",
        "RSS MB",
        "x floor",
        "net x",
        "peak MB",
        "clip ms",
        "note",
    ]
    lines = [head, "", _row(cols), _row(["-" * len(c) for c in cols])]
    for key, row in result.rows.items():
        state = row["state_bytes"]
        lines.append(
            _row(
                [
                    IMPLS[key].label,
                    _fmt(row["step_s"], 1e3),
                    _fmt(rel[key]["vs_floor"], digits=2),
                    _fmt(rel[key]["vs_best_peer"], digits=2),
                    _fmt(row.get("host_s"), 1e3, 3),
                    _fmt(row.get("syncs"), digits=0),
                    _fmt(row.get("peak_over_steady"), 1 / MB),
                    _fmt(row.get("cpu_s"), 1e3),
                    _fmt(row.get("busy_cores"), digits=2),
                    _fmt(row["wire_bytes"] / MB),
                    _fmt(max(state) / MB),
                    _fmt(row["state_imbalance"], digits=2),
                    _fmt(_rss(row, "steady"), 1 / MB, 0),
                    _fmt(rel[key]["rss_vs_floor"], digits=3),
                    _fmt(rel[key]["net_rss_vs_floor"], digits=3),
                    _fmt(_rss(row, "peak"), 1 / MB, 0),
                    _fmt(row["clip_s"], 1e3),
                    row["note"],
                ]
            )
        )
    lines.append(
        "step ms: median over the steps of the slowest rank (CUDA events on a GPU); host ms: "
        "until step() returned; syncs: device-to-host syncs of one step (host reads on CPU); "
        "dev pk MB: device memory a step peaks at over steady (CUDA); CPU ms: CPU time of one "
        "step summed over the ranks (every thread, user + system); busy: CPU / step time, in "
        f"cores (this machine has {machine['cores']})"
    )
    for key, reason in result.skipped.items():
        lines.append(f"skipped {IMPLS[key].label}: {reason}")
    return "\n".join(lines)


def sweep_lines(result: BenchResult) -> list[str]:
    """The sweeps' tables (none without sweeps): step ms by model size and by world size."""
    return _sweep_lines("step ms by model size (M params)", result.size_sweep) + _sweep_lines(
        "step ms by world size", result.world_sweep
    )


_WIDTHS = [30, 8, 7, 7, 8, 5, 9, 7, 5, 8, 9, 6, 7, 7, 6, 8, 8, 0]


def _row(cells: list[str]) -> str:
    out = [cells[0].ljust(_WIDTHS[0])]
    out += [c.rjust(w) for c, w in zip(cells[1:-1], _WIDTHS[1:-1])]
    return "  ".join(out + [cells[-1]]).rstrip()


def _sweep_lines(title: str, sweep: dict[str, dict[str, float]]) -> list[str]:
    if not sweep:
        return []
    keys = list(dict.fromkeys(k for row in sweep.values() for k in row))
    lines = ["", title, "  ".join([f"{'':>8}"] + [f"{k:>14}" for k in keys] + [" oss_plus/floor"])]
    for point, row in sweep.items():
        cells = [f"{float(point):>8g}"] + [f"{_fmt(row.get(k), 1e3):>14}" for k in keys]
        ratio = row["oss_plus"] / row["floor"] if "oss_plus" in row and row.get("floor") else None
        lines.append("  ".join(cells + [f"{_fmt(ratio, digits=2):>15}"]))
    return lines


def to_json(result: BenchResult, path: Path) -> None:
    """Write the result, with the derived ratios, as JSON."""
    data = asdict(result)
    data["ratios"] = ratios(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def plot(result: BenchResult, path: Path) -> str:
    """Draw step time and memory per implementation and step time against model size.

    Returns:
        A note: where the plot went, or why there is none (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_PLOT
    sweeps = [
        (sweep, label)
        for sweep, label in (
            (result.size_sweep, "model size, M params"),
            (result.world_sweep, "world size"),
        )
        if sweep
    ]
    panels = 2 + len(sweeps)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5), squeeze=False)
    _bars(axes[0][0], result)
    _memory(axes[0][1], result)
    for ax, (sweep, label) in zip(axes[0][2:], sweeps):
        _sweep(ax, sweep, label)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def _bars(ax: Any, result: BenchResult) -> None:
    keys = list(result.rows)
    steps = [result.rows[k]["step_s"] * 1e3 for k in keys]
    low = [s - result.rows[k]["step_p10_s"] * 1e3 for s, k in zip(steps, keys)]
    high = [result.rows[k]["step_p90_s"] * 1e3 - s for s, k in zip(steps, keys)]
    colors = [
        "tab:green"
        if k.startswith("oss_plus")
        else "tab:gray"
        if k in ("floor", "unsharded")
        else "tab:orange"
        for k in keys
    ]
    ax.barh([IMPLS[k].label for k in keys], steps, xerr=[low, high], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("median step time, ms (p10-p90)")
    ax.set_title(f"{result.config['size']:g}M params, {result.config['world_size']} ranks")


def _memory(ax: Any, result: BenchResult) -> None:
    keys = [k for k in result.rows if "rss" in result.rows[k]]
    if not keys:
        ax.set_title("memory not measured")
        return
    labels = [IMPLS[k].label for k in keys]
    steady = [(_rss(result.rows[k], "steady") or 0) / MB for k in keys]
    peak = [(_rss(result.rows[k], "peak") or 0) / MB for k in keys]
    ys = list(range(len(keys)))
    ax.barh([y - 0.2 for y in ys], steady, height=0.4, label="steady RSS")
    ax.barh([y + 0.2 for y in ys], peak, height=0.4, label="peak RSS")
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB per rank (max over ranks)")
    ax.set_xlim(0, 1.3 * max(peak + steady))
    ax.set_title("resident memory per rank")
    ax.legend(loc="lower right")


def _sweep(ax: Any, sweep: dict[str, dict[str, float]], xlabel: str) -> None:
    keys = list(dict.fromkeys(k for row in sweep.values() for k in row))
    xs = [float(x) for x in sweep]
    for key in keys:
        ax.plot(
            xs,
            [sweep[x].get(key, float("nan")) * 1e3 for x in sweep],
            marker="o",
            label=IMPLS[key].label,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("median step time, ms")
    ax.legend()
    ax.set_title("step time against " + xlabel.split(",")[0])


def summary_lines(result: BenchResult) -> list[str]:
    """The target ratios in one line each (what docs/benchmarks.md quotes)."""
    rel = ratios(result)
    lines = []
    for key in [k for k in rel if k.startswith("oss_plus") and k != "oss_plus_sync"]:
        r = rel[key]
        lines.append(
            f"{IMPLS[key].label}: {_fmt(r['vs_floor'], digits=2)}x floor, "
            f"{_fmt(r['vs_best_peer'], digits=2)}x best peer, RSS "
            f"{_fmt(r['rss_vs_floor'], digits=3)}x floor "
            f"({_fmt(r['net_rss_vs_floor'], digits=3)}x above the process baseline)"
            + (f", {r['vs_fp32']:.2f}x the fp32 step" if "vs_fp32" in r else "")
        )
    lines += _cpu_bound_lines(result)
    lines += main_copy_lines(result)
    for fp32, bf16 in (("oss_plus", "oss_plus_bf16"), ("oss_plus", "oss_plus_fp16")):
        if fp32 in result.rows and bf16 in result.rows and result.rows[fp32]["wire_bytes"]:
            w32, w16 = result.rows[fp32]["wire_bytes"], result.rows[bf16]["wire_bytes"]
            t32, t16 = result.rows[fp32]["step_s"], result.rows[bf16]["step_s"]
            lines.append(
                f"{IMPLS[bf16].label} / {IMPLS[fp32].label}: wire bytes {w16 / w32:.2f}x, "
                f"step {t16 / t32:.2f}x"
            )
    return lines


def _cpu_bound_lines(result: BenchResult) -> list[str]:
    """How far overlap could go: the step's CPU work over the cores, against the floor."""
    rows, cores = result.rows, result.machine["cores"]
    floor = rows.get("floor", {})
    if not cores or not floor.get("cpu_s"):
        return []
    lines = []
    for key in ("oss_plus", "oss_plus_sync"):
        cpu = rows.get(key, {}).get("cpu_s")
        if cpu:
            lines.append(
                f"{IMPLS[key].label}: {cpu * 1e3:.1f} CPU ms per step over {cores} cores "
                f"(floor {floor['cpu_s'] * 1e3:.1f}): no schedule finishes it in under "
                f"{cpu / cores * 1e3:.1f} ms = "
                f"{cpu / cores / floor['step_s']:.2f}x the floor's step"
            )
    return lines


def main_copy_lines(result: BenchResult) -> list[str]:
    """Per compressed row: the main copies' memory per rank (most loaded rank), per element
    sent compressed and against the params' bytes (the issue-36 target: 4 bytes)."""
    lines = []
    for key, row in result.rows.items():
        mains, numels = row.get("main_bytes") or [], row.get("compressed_numel") or []
        if not any(mains):
            continue
        rank = max(range(len(mains)), key=lambda r: mains[r])
        per = mains[rank] / numels[rank] if numels[rank] else float("nan")
        lines.append(
            f"{IMPLS[key].label}: main copies {mains[rank] / MB:.1f} MiB on the most loaded "
            f"rank, {per:.2f} bytes per element it sends compressed "
            f"({sum(mains) / MB:.1f} MiB over {len(mains)} ranks)"
        )
    return lines
