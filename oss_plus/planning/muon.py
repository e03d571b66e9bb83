"""Muon at scale (PURE): the compute and the state of each rank, per partition rule, as
``oss-plus plan --optimizer muon`` reports them.

``torch.optim.Muon`` steps 2-D params only (it raises ``ValueError`` for any other) and is
meant for the hidden matrices: embeddings, the output head, norms and biases go to a
second optimizer, AdamW (torch's own example). So the plan assumes two ``OSS`` instances
under the same partition rule: ``OSS(hidden, optim=torch.optim.Muon)`` on the trainable
2-D params that are not embeddings or the head (:func:`split_for_muon`), and
``OSS(others, optim=torch.optim.AdamW)`` on the rest. Muon keeps one fp32 momentum buffer
per element (:data:`MUON_STATE`); AdamW two moments and a step.

A Muon step is compute-bound: the Newton-Schulz iterations of each matrix
(:func:`~oss_plus.planning.ns_cost.ns_flops`) cost far more than its elementwise work, and
every rank waits for the slowest before the parameter sync. :func:`rank_flops` sums them
per rank; :class:`CostRow` gives the most loaded rank against the mean. The fairscale rule
places by element count in the given order, the torch rule by element count largest first,
the muon rule (:attr:`~oss_plus.planning.partition.Rule.MUON`) by these FLOPs largest first.
The flat rule is refused for Muon (its update of a matrix reads the whole matrix).

Example:
    >>> from oss_plus.planning.model_specs import specs_from_shapes
    >>> specs = specs_from_shapes([(16, 16), (2, 128), (8, 32), (8, 32), (16,)])
    >>> split = split_for_muon(specs)
    >>> len(split.hidden), len(split.others)
    (4, 1)
    >>> [(r.rule, round(r.ratio, 3)) for r in cost_rows(split, [2])]
    [('fairscale', 1.499), ('torch', 1.499), ('muon', 1.091)]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oss_plus.planning.ns_cost import NS_STEPS, ns_flops
from oss_plus.planning.optim_state import OPTIMIZER_STATES, OptimizerState
from oss_plus.planning.partition import ParamSpec, Rule
from oss_plus.planning.plan import make_plan
from oss_plus.planning.policy import ShardPolicy
from oss_plus.planning.scale import ScaleRow, Topology, rank_numels, scale_rows
from oss_plus.planning.tables import print_table, scale_cells

__all__ = [
    "FLAT_NOT_MUON",
    "MUON_RULES",
    "MUON_STATE",
    "CostRow",
    "MuonSplit",
    "cost_rows",
    "muon_scale_rows",
    "print_report",
    "rank_flops",
    "rank_state",
    "recommendation",
    "split_for_muon",
]

#: torch.optim.Muon's state: one fp32 ``momentum_buffer`` per element, no step counter.
MUON_STATE = OptimizerState("muon", "torch.optim.Muon", 1, step_bytes=0)
#: The rules ``OSS`` accepts for Muon (the flat rule cuts matrices: refused).
MUON_RULES = (Rule.FAIRSCALE, Rule.TORCH, Rule.MUON)
#: Printed instead of the flat rule's rows under ``--optimizer muon``.
FLAT_NOT_MUON = (
    "flat: no rows; OSS refuses torch.optim.Muon under partition_rule='flat' (its update of "
    "a matrix reads the whole matrix, the flat rule cuts matrices across ranks)"
)
#: Two rules' max/mean within this relative difference count as equal.
_TIE = 1e-9


@dataclass(frozen=True)
class MuonSplit:
    """The params of the Muon ``OSS`` (``hidden``) and of the AdamW ``OSS`` (``others``)."""

    hidden: tuple[ParamSpec, ...]
    others: tuple[ParamSpec, ...]


def split_for_muon(specs: Sequence[ParamSpec], embeddings: Iterable[int] = ()) -> MuonSplit:
    """Muon's params: the trainable 2-D specs whose index is not in ``embeddings``
    (negative indices count from the end); every other spec goes to AdamW.

    Raises:
        ValueError: a spec without a shape, or no param for Muon.
    """
    if any(s.shape is None for s in specs):
        raise ValueError("--optimizer muon needs the params' shapes (ParamSpec.shape)")
    skip = {i % len(specs) for i in embeddings} if specs else set()
    mine = [i not in skip and s.trainable and len(s.shape or ()) == 2 for i, s in enumerate(specs)]
    hidden = tuple(s for s, m in zip(specs, mine) if m)
    if not hidden:
        raise ValueError(
            "--optimizer muon: no trainable 2-D param outside the embeddings and the head, "
            "so Muon would step nothing"
        )
    return MuonSplit(hidden, tuple(s for s, m in zip(specs, mine) if not m))


def rank_flops(specs: Sequence[ParamSpec], ranks: int, rule: Rule | str) -> list[int]:
    """Newton-Schulz FLOPs per step of every rank when ``specs`` (one param group) are
    sharded over ``ranks`` by a whole-tensor ``rule``.

    Example:
        >>> from oss_plus.planning.model_specs import specs_from_shapes
        >>> rank_flops(specs_from_shapes([(2, 3), (4, 4), (2, 2)]), 2, "torch")
        [1920, 560]
    """
    plan = make_plan([list(specs)], ranks, ShardPolicy(rule=Rule(rule)))
    flops = [0] * ranks
    for piece in plan.pieces:
        spec = specs[piece.index]
        if spec.trainable and spec.shape is not None:
            flops[piece.owner] += ns_flops(spec.shape)
    return flops


def _numels(split: MuonSplit, ranks: int, rule: Rule | str) -> list[tuple[list[int], list[int]]]:
    """Per rank, the element counts of its tensors in the Muon and in the AdamW ``OSS``."""
    hidden = rank_numels(split.hidden, ranks, rule)
    others = rank_numels(split.others, ranks, rule) if split.others else [[]] * ranks
    return list(zip(hidden, others))


def rank_state(split: MuonSplit, ranks: int, rule: Rule | str, adamw: OptimizerState) -> int:
    """Optimizer-state bytes of the most loaded rank: its Muon momentum plus its share of
    the AdamW ``OSS`` (planned by the same rule)."""
    per_rank = _numels(split, ranks, rule)
    return max(MUON_STATE.rank_bytes(h) + adamw.rank_bytes(o) for h, o in per_rank)


def muon_scale_rows(
    split: MuonSplit,
    topology: Topology,
    rules: Iterable[Rule | str],
    shard_sizes: Iterable[int],
    width: int = 4,
    backend: str = "nccl",
    adamw: OptimizerState = OPTIMIZER_STATES["adamw"],
) -> list[ScaleRow]:
    """:func:`~oss_plus.planning.scale.scale_rows` for the two ``OSS`` of the module doc:
    bytes held and sent add up over both; a rank's state (and its ZeRO-2 gradients) is its
    share of each, summed per rank before the most loaded rank is taken."""
    chosen, sizes = [Rule(r) for r in rules], list(shard_sizes)

    def rows_of(specs: Sequence[ParamSpec], state: OptimizerState) -> list[ScaleRow]:
        return scale_rows(specs, topology, chosen, sizes, width, backend=backend, state=state)

    hidden = rows_of(split.hidden, MUON_STATE)
    if not split.others:
        return hidden
    others = rows_of(split.others, adamw)
    rows = []
    for h, o in zip(hidden, others):
        state, grads = h.state + o.state, h.grads + o.grads
        if h.rule != "-":  # an OSS over h.shard ranks: per rank, then the most loaded
            per_rank = _numels(split, h.shard, h.rule)
            state = max(MUON_STATE.rank_bytes(a) + adamw.rank_bytes(b) for a, b in per_rank)
            if h.stage.endswith("zero2"):  # each rank keeps the gradients it owns
                grads = max(sum(a) + sum(b) for a, b in per_rank) * width
        sums = (h.params + o.params, grads, state, h.intra + o.intra, h.inter + o.inter)
        rows.append(ScaleRow(h.stage, h.rule, h.shard, *sums))
    return rows


@dataclass(frozen=True)
class CostRow:
    """The Muon step's compute and the state of one rule over ``ranks`` ranks.

    Attributes:
        rule: the partition rule.
        ranks: the ranks the optimizers shard over.
        max_flops: Newton-Schulz FLOPs per step of the most loaded rank.
        mean_flops: the total over ``ranks``.
        state: optimizer-state bytes of the most loaded rank (Muon and AdamW).
    """

    rule: str
    ranks: int
    max_flops: int
    mean_flops: float
    state: int

    @property
    def ratio(self) -> float:
        """``max_flops / mean_flops``: the step time over the ideal (1.0: balanced)."""
        return self.max_flops / self.mean_flops


def cost_rows(
    split: MuonSplit,
    sizes: Iterable[int],
    rules: Iterable[Rule | str] = MUON_RULES,
    adamw: OptimizerState = OPTIMIZER_STATES["adamw"],
) -> list[CostRow]:
    """One :class:`CostRow` per shard size (outermost) and rule.

    Raises:
        ValueError: the flat rule (refused for Muon), or a size < 1.
    """
    chosen = [Rule(r) for r in rules]
    if Rule.FLAT in chosen:
        raise ValueError(FLAT_NOT_MUON)
    rows = []
    for n in sizes:
        if n < 1:
            raise ValueError(f"shard sizes must be >= 1, got {n}")
        for rule in chosen:
            flops = rank_flops(split.hidden, n, rule)
            state = rank_state(split, n, rule, adamw)
            rows.append(CostRow(rule.value, n, max(flops), sum(flops) / n, state))
    return rows


def recommendation(rows: Sequence[CostRow], ranks: int) -> str:
    """Which rule to use for Muon over ``ranks`` ranks: the lowest max/mean among ``rows``
    (every rule that ties it), with the others' numbers.

    Example:
        >>> rows = [CostRow("fairscale", 4, 15, 10.0, 0), CostRow("torch", 4, 12, 10.0, 0)]
        >>> recommendation(rows, 4)
        'for Muon over 4 ranks use partition_rule="torch" (max/mean 1.200x; fairscale 1.500x)'
    """
    mine = [r for r in rows if r.ranks == ranks]
    best = min(r.ratio for r in mine)
    tied = [r.rule for r in mine if r.ratio <= best * (1 + _TIE)]
    rest = "; ".join(f"{r.rule} {r.ratio:.3f}x" for r in mine if r.rule not in tied)
    names = " or ".join(f'"{rule}"' for rule in tied)
    tail = f"; {rest})" if rest else ")"
    return f"for Muon over {ranks} ranks use partition_rule={names} (max/mean {best:.3f}x{tail}"


def print_report(
    args: Any,
    name: str,
    specs: Sequence[ParamSpec],
    topology: Topology,
    sizes: Sequence[int],
    embeddings: Iterable[int] = (),
) -> int:
    """``oss-plus plan --optimizer muon``: the stage table of :func:`muon_scale_rows`, then
    the Newton-Schulz FLOPs of every rule (:func:`cost_rows`) at the world and each shard
    size, and :func:`recommendation` at the world (``args``: the plan command's options).
    """
    split = split_for_muon(specs, embeddings)
    rules = [r for r in args.rules if r is not Rule.FLAT]
    if not rules:
        raise ValueError(f"{FLAT_NOT_MUON}: give --rules among fairscale,torch,muon")
    ranks = sorted({topology.world, *sizes}, reverse=True)
    rows = muon_scale_rows(split, topology, rules, sizes, args.bytes, args.backend)
    costs = cost_rows(split, ranks, rules)
    advice = recommendation(costs, topology.world)
    if args.json:
        report = {"source": name, "nodes": args.nodes, "per_node": args.per_node}
        report |= {"bytes": args.bytes, "backend": args.backend, "optimizer": "muon"}
        report |= {"rows": [r.as_dict() for r in rows], "recommendation": advice}
        report["newton_schulz"] = [{**dataclasses.asdict(c), "ratio": c.ratio} for c in costs]
        print(json.dumps(report, indent=2))
        return 0
    _print_text(args, name, specs, split, len(rules) < len(args.rules), rows, costs)
    print(advice)
    return 0


def _print_text(
    args: Any,
    name: str,
    specs: Sequence[ParamSpec],
    split: MuonSplit,
    refused: bool,
    rows: Sequence[ScaleRow],
    costs: Sequence[CostRow],
) -> None:
    """The tables of :func:`print_report` (``refused``: the flat rule was asked for)."""
    print(
        f"{name}: {sum(s.numel for s in specs if s.trainable):,} trainable elements, "
        f"{args.nodes} nodes x {args.per_node} ranks, {args.bytes} B per param/grad/wire "
        f"element, Muon + AdamW state, {args.backend}; GB = 1e9 bytes per rank (held) and "
        "per rank and step (sent)"
    )
    print(_muon_line(split))
    if refused:
        print(FLAT_NOT_MUON)
    table = [["stage", "rule", "S", "params", "grads", "state", "intra-node", "inter-node"]]
    print_table(table + [scale_cells(r) for r in rows], left=2)
    print(
        f"Newton-Schulz per step ({NS_STEPS} iterations, 2 x {NS_STEPS} x s^2 x (2l + s) FLOPs "
        "per m x n matrix, s = min, l = max), the most loaded rank of the Muon OSS against "
        "the mean, over the world and each shard size S:"
    )
    table = [["rule", "S", "TFLOP max rank", "TFLOP mean", "max/mean", "state GB"]]
    for c in costs:
        flops = (f"{c.max_flops / 1e12:,.3f}", f"{c.mean_flops / 1e12:,.3f}")
        table.append([c.rule, str(c.ranks), *flops, f"{c.ratio:.3f}", f"{c.state / 1e9:,.2f}"])
    print_table(table, left=1)


def _muon_line(split: MuonSplit) -> str:
    hidden = sum(s.numel for s in split.hidden)
    others = [s for s in split.others if s.trainable]
    return (
        f"state: torch.optim.Muon on {len(split.hidden)} hidden 2-D matrices "
        f"({hidden:,} elements): 4 B per element (momentum); torch.optim.AdamW, a second OSS "
        f"under the same rule, on the other {len(others)} trainable params (embeddings, "
        f"head, norms, biases; {sum(s.numel for s in others):,} elements): 8 B per element, "
        "4 B per tensor"
    )
