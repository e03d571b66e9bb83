"""How evenly each partition rule spreads a model's optimizer state (PURE planning), and the
``oss-plus plan`` command.

The model is one :class:`~oss_plus.partition.ParamSpec` per parameter
(:mod:`oss_plus.model_specs`: shapes, built-in models, module factories), planned with
:func:`oss_plus.plan.make_plan` for every rule and world size (:func:`balance_rows`). With
``--nodes N --per-node G`` the command prints the memory and bytes per step of every stage
at that topology instead (:mod:`oss_plus.scale_report`). No process group is involved.

    oss-plus plan --model llama2-7b --world-sizes 8,64,256,1024 --rules fairscale,torch,flat
    oss-plus plan --model llama2-70b --nodes 64 --per-node 8

Example:
    >>> rows = balance_rows(parse_shapes("10x10,10,5"), [2], ["torch", "flat"])
    >>> [(r.rule, r.world_size, r.max_load, r.empty) for r in rows]
    [('torch', 2, 100, 0), ('flat', 2, 80, 0)]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oss_plus.model_specs import (
    MODELS,
    gpt2_shapes,
    llama_shapes,
    model_specs,
    parse_shapes,
    read_shapes,
    specs_from_module,
    specs_from_shapes,
)
from oss_plus.partition import ParamSpec, Rule
from oss_plus.plan import ShardPolicy, make_plan

__all__ = [
    "FLAT_ALIGN",
    "MODELS",
    "BalanceRow",
    "balance_rows",
    "gpt2_shapes",
    "llama_shapes",
    "model_specs",
    "parse_shapes",
    "read_shapes",
    "register",
    "specs_from_module",
    "specs_from_shapes",
]

#: Element alignment of the flat rule's offsets in the report: fp32 on the CPU (64 bytes).
FLAT_ALIGN = 16
#: The one flat-buffer key of the report's specs (every param in one buffer).
FLAT_KEY = "cpu/torch.float32"
#: Raised when no parameter would carry optimizer state.
NO_TRAINABLE = "the model has no trainable parameters: nothing to partition"


# ------------------------------------------------------------------ the report
@dataclass(frozen=True)
class BalanceRow:
    """The optimizer-state balance of one rule at one world size.

    Attributes:
        rule: the partition rule's value.
        world_size: the number of ranks N.
        max_load: trainable elements of the most loaded rank.
        ideal: total trainable elements / N.
        empty: ranks that own no trainable element (no optimizer state).
    """

    rule: str
    world_size: int
    max_load: int
    ideal: float
    empty: int

    @property
    def ratio(self) -> float:
        """``max_load / ideal``: 1.0 is a perfect balance."""
        return self.max_load / self.ideal

    def as_dict(self) -> dict[str, Any]:
        """Return the row as plain JSON data (the ratio included)."""
        return {**dataclasses.asdict(self), "ratio": self.ratio}


def balance_rows(
    specs: Sequence[ParamSpec],
    world_sizes: Iterable[int],
    rules: Iterable[Rule | str],
    align: int = FLAT_ALIGN,
) -> list[BalanceRow]:
    """Plan ``specs`` (one param group) for every rule and world size.

    Args:
        specs: one spec per parameter; frozen ones carry no optimizer state.
        world_sizes: the numbers of ranks N to plan for.
        rules: :class:`~oss_plus.partition.Rule` s or their values.
        align: under the flat rule every spec gets this ``align`` and the one key
            :data:`FLAT_KEY` (the report puts every parameter in one buffer).

    Returns:
        One row per (rule, world size), rules outermost, in the given orders.

    Raises:
        ValueError: a world size < 1, an unknown rule, or no trainable parameter.
    """
    total = sum(s.numel for s in specs if s.trainable)
    if total == 0:
        raise ValueError(NO_TRAINABLE)
    flat = [dataclasses.replace(s, key=FLAT_KEY, align=align) for s in specs]
    rows = []
    world_sizes = list(world_sizes)
    for rule in map(Rule, rules):
        for n in world_sizes:
            if n < 1:
                raise ValueError(f"world sizes must be >= 1, got {n}")
            groups = [flat if rule is Rule.FLAT else list(specs)]
            loads = make_plan(groups, n, ShardPolicy(rule=rule)).rank_loads()
            rows.append(BalanceRow(rule.value, n, max(loads), total / n, loads.count(0)))
    return rows


# ------------------------------------------------------------------ oss-plus plan
def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas (8,64,256), got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _rules(text: str) -> list[Rule]:
    try:
        return [Rule(r.strip()) for r in text.split(",")]
    except ValueError:
        known = ",".join(r.value for r in Rule)
        raise argparse.ArgumentTypeError(f"rules are among {known}, got {text!r}") from None


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand (the balance table of :func:`balance_rows`)."""
    parser = subparsers.add_parser(
        "plan",
        help="how evenly each partition rule spreads a model's optimizer state",
        description="Plan a model's parameters over N ranks by each partition rule (no "
        "processes) and print the largest rank's trainable elements over the ideal 1/N.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(MODELS), help="a built-in model")
    source.add_argument(
        "--shapes", metavar="FILE_OR_LIST", help="shapes: '4096x4096,4096', or a file of them"
    )
    source.add_argument(
        "--module",
        metavar="PKG.MOD:FACTORY",
        help="a callable returning a torch.nn.Module (built on the meta device; import path "
        "from PYTHONPATH)",
    )
    parser.add_argument(
        "--world-sizes", type=_positive_ints, default=[8, 64, 256, 1024], metavar="N,N,..."
    )
    parser.add_argument(
        "--rules", type=_rules, default=list(Rule), metavar="RULE,...", help="default: all"
    )
    parser.add_argument(
        "--align",
        type=lambda t: _positive_ints(t)[0],
        default=FLAT_ALIGN,
        help=f"element alignment of the flat rule (default {FLAT_ALIGN}: fp32, 64 bytes)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_plan)


def _source_specs(args: argparse.Namespace) -> tuple[str, list[ParamSpec]]:
    if args.model is not None:
        return args.model, model_specs(args.model)
    if args.shapes is not None:
        return args.shapes, read_shapes(args.shapes)
    return args.module, specs_from_module(args.module)


def _plan(args: argparse.Namespace) -> int:
    name, specs = _source_specs(args)
    rows = balance_rows(specs, args.world_sizes, args.rules, args.align)
    total = sum(s.numel for s in specs)
    trainable = sum(s.numel for s in specs if s.trainable)
    if args.json:
        report = {"source": name, "params": len(specs), "elements": total}
        report |= {"trainable": trainable, "align": args.align}
        print(json.dumps({**report, "rows": [r.as_dict() for r in rows]}, indent=2))
        return 0
    print(f"{name}: {len(specs)} params, {total:,} elements, {trainable:,} trainable")
    table = [["rule", "N", "ideal", "max rank", "max/ideal", "empty"]]
    for r in rows:
        cells = [f"{r.ideal:,.0f}", f"{r.max_load:,}", f"{r.ratio:.3f}", str(r.empty)]
        table.append([r.rule, str(r.world_size), *cells])
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    for row in table:
        line = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("  ".join(line), file=sys.stdout)
    return 0
