"""The guides under docs/ stay readable: at most 300 lines each (issue 55, item 5).

The reference pages (design.md: the architecture; benchmarks.md: the measured tables) are
exempt; a guide that outgrows the limit moves a section to the page it belongs to.
"""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
LIMIT = 300
REFERENCE = {"design.md", "benchmarks.md"}


def test_every_guide_is_at_most_300_lines():
    lengths = {
        p.name: len(p.read_text().splitlines())
        for p in sorted(DOCS.glob("*.md"))
        if p.name not in REFERENCE
    }
    assert {"partition.md", "migration.md", "reliability.md"} <= set(lengths)
    too_long = {name: n for name, n in lengths.items() if n > LIMIT}
    assert not too_long, too_long
