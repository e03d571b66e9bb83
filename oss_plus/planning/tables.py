"""Plain-text tables of ``oss-plus plan`` (PURE)."""

from __future__ import annotations

import sys

from oss_plus.planning.scale import ScaleRow

__all__ = ["print_table", "scale_cells"]


def print_table(table: list[list[str]], left: int) -> None:
    """Print ``table`` with its first ``left`` columns left-aligned, the others right."""
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    for row in table:
        line = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(line), file=sys.stdout)


def scale_cells(r: ScaleRow) -> list[str]:
    """One row of the stage table: stage, rule, S, then GB held and sent."""
    sizes = (r.params, r.grads, r.state, r.intra, r.inter)
    return [r.stage, r.rule, str(r.shard), *(f"{b / 1e9:,.2f}" for b in sizes)]
