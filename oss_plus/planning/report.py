"""How evenly each partition rule spreads a model's optimizer state (PURE planning), and the
``oss-plus plan`` command.

The model is one :class:`~oss_plus.planning.partition.ParamSpec` per parameter
(:mod:`oss_plus.planning.model_specs`: shapes, built-in models, module factories), planned with
:func:`oss_plus.planning.plan.make_plan` for every rule and world size (:func:`balance_rows`). With
``--nodes N --per-node G`` the command prints the memory and bytes per step of every stage
at that topology instead (:mod:`oss_plus.planning.scale`). No process group is involved.

    oss-plus plan --model llama2-7b --world-sizes 8,64,256,1024 --rules fairscale,torch,flat
    oss-plus plan --model llama2-70b --nodes 64 --per-node 8
    oss-plus plan --model llama2-7b --nodes 16 --per-node 8 --optimizer muon

With ``--optimizer muon`` it also prints each rule's Newton-Schulz FLOPs per step of the most
loaded rank against the mean, and which rule to use (:mod:`oss_plus.planning.muon`).

Example:
    >>> rows = balance_rows(parse_shapes("10x10,10,5"), [2], ["torch", "flat"])
    >>> [(r.rule, r.world_size, r.max_load, r.empty) for r in rows]
    [('torch', 2, 100, 0), ('flat', 2, 80, 0)]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oss_plus.planning import muon
from oss_plus.planning.model_specs import (
    EMBEDDINGS,
    MODELS,
    gpt2_shapes,
    llama_shapes,
    model_specs,
    module_embeddings,
    parse_shapes,
    read_shapes,
    specs_from_module,
    specs_from_shapes,
)
from oss_plus.planning.optim_state import OPTIMIZER_STATES, OptimizerState
from oss_plus.planning.partition import ParamSpec, Rule
from oss_plus.planning.scale import FLAT_ALIGN, Topology, rank_loads, scale_rows
from oss_plus.planning.tables import print_table, scale_cells

__all__ = [
    "FLAT_ALIGN",
    "MODELS",
    "BalanceRow",
    "balance_rows",
    "default_shard_sizes",
    "gpt2_shapes",
    "llama_shapes",
    "model_specs",
    "parse_shapes",
    "read_shapes",
    "register",
    "specs_from_module",
    "specs_from_shapes",
]

#: The rules of ``oss-plus plan`` without --rules (the muon rule balances FLOPs, not bytes:
#: it comes with --optimizer muon).
DEFAULT_RULES = (Rule.FAIRSCALE, Rule.TORCH, Rule.FLAT)
#: Optimizer-state bytes per element without --state-bytes or --optimizer (Adam: 2 x fp32).
DEFAULT_STATE_BYTES = 8
#: Raised for --optimizer without a topology ({name}: the optimizer given).
OPTIMIZER_NEEDS_TOPOLOGY = (
    "--optimizer {name} counts each rank's memory at a topology: add --nodes N --per-node G "
    "(e.g. --nodes 1 --per-node 8), or drop --optimizer for the balance table alone"
)
#: Raised for --optimizer together with --state-bytes.
OPTIMIZER_OR_STATE_BYTES = (
    "--optimizer {name} sets the state bytes itself: drop --state-bytes {state_bytes:g}, or "
    "drop --optimizer to count {state_bytes:g} B of state per element"
)
#: Printed instead of the flat rule's rows for a block-quantized optimizer.
FLAT_REFUSED = (
    "flat: no rows; OSS refuses {name} under partition_rule='flat' (its quantization blocks "
    "do not follow the flat rule's element ranges; docs/lowbit.md)"
)
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
        rules: :class:`~oss_plus.planning.partition.Rule` s or their values.
        align: under the flat rule every spec gets this ``align`` and the one key
            :data:`oss_plus.planning.scale.FLAT_KEY` (every parameter in one buffer).

    Returns:
        One row per (rule, world size), rules outermost, in the given orders.

    Raises:
        ValueError: a world size < 1, an unknown rule, or no trainable parameter.
    """
    total = sum(s.numel for s in specs if s.trainable)
    if total == 0:
        raise ValueError(NO_TRAINABLE)
    rows = []
    world_sizes = list(world_sizes)
    for rule in map(Rule, rules):
        for n in world_sizes:
            if n < 1:
                raise ValueError(f"world sizes must be >= 1, got {n}")
            loads = rank_loads(specs, n, rule, align)
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
        "--rules",
        type=_rules,
        metavar="RULE,...",
        help="default: fairscale,torch,flat; with --optimizer muon: fairscale,torch,muon",
    )
    parser.add_argument(
        "--align",
        type=lambda t: _positive_ints(t)[0],
        default=FLAT_ALIGN,
        help=f"element alignment of the flat rule (default {FLAT_ALIGN}: fp32, 64 bytes)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    scale = parser.add_argument_group(
        "topology", "with --nodes and --per-node: memory and bytes per step of every stage"
    )
    scale.add_argument("--nodes", type=_one_int, metavar="N", help="nodes")
    scale.add_argument("--per-node", type=_one_int, metavar="G", help="ranks per node")
    scale.add_argument(
        "--shard-sizes",
        type=_positive_ints,
        metavar="S,S,...",
        help="hybrid shard sizes (default: every power of two from 2 that divides N x G, "
        "below N x G, and G)",
    )
    scale.add_argument(
        "--bytes", type=_one_int, default=4, help="bytes per parameter, gradient, wire element"
    )
    scale.add_argument(
        "--state-bytes",
        type=_one_int,
        help=f"optimizer state per element (default {DEFAULT_STATE_BYTES}: Adam's two fp32)",
    )
    scale.add_argument(
        "--optimizer",
        choices=[*OPTIMIZER_STATES, "muon"],
        help="count each rank's state as this optimizer lays it out, tensor by tensor "
        "(low-bit codes, block scales, fp32 for small tensors) instead of --state-bytes; "
        "muon: torch.optim.Muon on the hidden matrices and AdamW on the rest, with the "
        "Newton-Schulz FLOPs of every rule",
    )
    scale.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.set_defaults(func=_plan)


def _one_int(text: str) -> int:
    return _positive_ints(text)[0]


def _source_specs(args: argparse.Namespace) -> tuple[str, list[ParamSpec]]:
    if args.model is not None:
        return args.model, model_specs(args.model)
    if args.shapes is not None:
        return args.shapes, read_shapes(args.shapes)
    return args.module, specs_from_module(args.module)


def _plan(args: argparse.Namespace) -> int:
    name, specs = _source_specs(args)
    if args.rules is None:
        args.rules = list(muon.MUON_RULES if args.optimizer == "muon" else DEFAULT_RULES)
    topology = args.nodes is not None or args.per_node is not None
    if args.optimizer is not None and args.state_bytes is not None:
        raise ValueError(
            OPTIMIZER_OR_STATE_BYTES.format(name=args.optimizer, state_bytes=args.state_bytes)
        )
    if args.optimizer is not None and not topology:
        raise ValueError(OPTIMIZER_NEEDS_TOPOLOGY.format(name=args.optimizer))
    if topology:
        return _scale(args, name, specs)
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
    print_table(table, left=1)
    return 0


def default_shard_sizes(topology: Topology) -> list[int]:
    """Every power of two from 2 that divides the world and is below it, and the node size.

    Example:
        >>> default_shard_sizes(Topology(8, 8))
        [2, 4, 8, 16, 32]
    """
    world = topology.world
    sizes = {2**k for k in range(1, world.bit_length()) if world % 2**k == 0 and 2**k < world}
    sizes |= {topology.per_node} if topology.per_node < world else set()
    return sorted(sizes)


def _scale(args: argparse.Namespace, name: str, specs: list[ParamSpec]) -> int:
    if args.nodes is None or args.per_node is None:
        raise ValueError(
            "--nodes and --per-node go together: give both (e.g. --nodes 8 --per-node 8)"
        )
    topology = Topology(args.nodes, args.per_node)
    sizes = args.shard_sizes or default_shard_sizes(topology)
    if args.optimizer == "muon":
        return muon.print_report(args, name, specs, topology, sizes, _embeddings(args))
    state = OPTIMIZER_STATES[args.optimizer] if args.optimizer else None
    width = DEFAULT_STATE_BYTES if args.state_bytes is None else args.state_bytes
    rules = list(args.rules)
    refused = state is not None and state.bits < 32 and Rule.FLAT in rules
    if refused:  # OSS refuses block-quantized optimizers under the flat rule
        rules.remove(Rule.FLAT)
    rows = scale_rows(
        specs, topology, rules, sizes, args.bytes, width, args.backend, args.align, state
    )
    if args.json:
        report = {"source": name, "nodes": args.nodes, "per_node": args.per_node}
        report |= {"bytes": args.bytes, "backend": args.backend}
        report |= {"optimizer": args.optimizer, "state_bytes": None if state else width}
        print(json.dumps({**report, "rows": [r.as_dict() for r in rows]}, indent=2))
        return 0
    trainable = sum(s.numel for s in specs if s.trainable)
    print(
        f"{name}: {trainable:,} trainable elements, {args.nodes} nodes x {args.per_node} ranks, "
        f"{args.bytes} B per param/grad/wire element, {_state_words(state, width)}, "
        f"{args.backend}; GB = 1e9 bytes per rank (held) and per rank and step (sent)"
    )
    if state is not None:
        print(_state_line(state, specs))
    if refused:
        print(FLAT_REFUSED.format(name=args.optimizer))
    table = [["stage", "rule", "S", "params", "grads", "state", "intra-node", "inter-node"]]
    table += [scale_cells(r) for r in rows]
    print_table(table, left=2)
    return 0


def _state_words(state: OptimizerState | None, width: int) -> str:
    return f"{width} B of state" if state is None else f"{state.name} state"


def _state_line(state: OptimizerState, specs: Sequence[ParamSpec]) -> str:
    """What the optimizer keeps, and how much of the unsharded model stays in fp32."""
    numels = [s.numel for s in specs if s.trainable and s.numel]
    fallback = [n for n in numels if not state.quantized(n)]
    total = state.rank_bytes(numels)
    kept = sum(state.tensor_bytes(n) for n in fallback)
    if state.bits == 32:
        return f"state: {state.describe()}; unsharded {total / 1e9:,.2f} GB"
    return (
        f"state: {state.describe()}; unsharded {total / 1e9:,.2f} GB, of which "
        f"{len(fallback)} of {len(numels)} tensors ({sum(fallback):,} elements) in fp32: "
        f"{kept / 1e9:,.4f} GB"
    )


def _embeddings(args: argparse.Namespace) -> tuple[int, ...]:
    """What Muon leaves to AdamW: a built-in model's embeddings and head, a module's
    ``nn.Embedding`` s and params of their shape; none for --shapes."""
    if args.model is not None:
        return EMBEDDINGS.get(args.model, ())
    return module_embeddings(args.module) if args.module is not None else ()
