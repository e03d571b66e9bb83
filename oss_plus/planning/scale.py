"""Memory and bytes per step of every stage at a topology of N nodes x G ranks (PURE).

For each partition rule and stage, what the most loaded rank holds (parameters, gradients,
optimizer state) and the bytes one rank sends per step, split by the links its collectives
cross: a collective whose group stays inside one node moves its bytes over intra-node links
(NVLink); one whose group spans nodes is bounded by the inter-node links (NICs), and all its
bytes are counted there (a ring over nodes sends every byte through a NIC at some hop).

Per-rank bytes of the bandwidth-optimal (ring) algorithms, ``n`` ranks, ``S`` bytes:
all-reduce ``2 (n - 1) / n * S``; reduce-scatter, or one reduce per owner of its share,
``(n - 1) / n * S``; per-owner broadcasts of ``S`` in all, ``(n - 1) / n * S``; an all-gather of
``n`` equal regions of ``r`` bytes, ``(n - 1) * r``. The parameter sync uses the transport
``transport="auto"`` picks on the backend (:func:`oss_plus.wire.transport.auto_gathers`).

Stages (``W = N x G`` ranks; ``S`` the shard size, ``W / S`` replicas):

* ``ddp``: DDP + the plain optimizer: all-reduce of the gradients over ``W``;
* ``zero1``: DDP + ``OSS`` over ``W``: the all-reduce, then the parameter sync over ``W``;
* ``zero2``: ``ShardedDataParallel`` over ``W``: gradients reduced to their owners, then the sync;
* ``hybrid-zero1``: DDP over ``W``, ``OSS`` sharded over ``S`` contiguous ranks: the sync
  stays inside the shard group;
* ``hybrid-zero2``: gradients reduced inside the shard group, each owner's share all-reduced
  across its ``W / S`` replicas, the sync inside the shard group;
* ``fsdp-hybrid``: FSDP ``HYBRID_SHARD`` (FSDP2 with a (replicate, shard) mesh): parameters
  all-gathered for forward and again for backward, gradients reduce-scattered inside the
  shard group and all-reduced across replicas; everything ``1 / S`` per rank (flat shards).

Example:
    >>> rows = scale_rows([10_000] * 8, Topology(2, 2), ["flat"], [2])
    >>> [(r.stage, r.shard, r.state) for r in rows][:3]
    [('ddp', 1, 640000), ('zero1', 4, 160000), ('zero2', 4, 160000)]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oss_plus.planning.optim_state import OptimizerState
from oss_plus.planning.partition import ParamSpec, Rule
from oss_plus.planning.plan import make_plan
from oss_plus.planning.policy import ShardPolicy
from oss_plus.planning.transport import auto_gathers, owner_key_elements

__all__ = [
    "FLAT_ALIGN",
    "FLAT_KEY",
    "ScaleRow",
    "Topology",
    "rank_loads",
    "rank_numels",
    "ring_bytes",
    "scale_rows",
]

#: Element alignment of the flat rule's offsets in the reports: fp32 on the CPU (64 bytes).
FLAT_ALIGN = 16
#: The one flat-buffer key of the reports' specs (every param in one buffer).
FLAT_KEY = "cpu/torch.float32"
#: Raised for a topology that is not N >= 1 nodes of G >= 1 ranks.
BAD_TOPOLOGY = "--nodes and --per-node must both be integers >= 1, got {nodes!r} x {per_node!r}"
#: Raised for a shard size that does not divide the world.
BAD_SHARD = (
    "shard size {size} does not divide the world of {world} ranks ({nodes} x {per_node}): "
    "choose a divisor of {world} (the node: {per_node})"
)


@dataclass(frozen=True)
class Topology:
    """``nodes`` nodes of ``per_node`` ranks each; ranks are numbered node by node.

    Raises:
        ValueError: a count below 1 (:data:`BAD_TOPOLOGY`).
    """

    nodes: int
    per_node: int

    def __post_init__(self) -> None:
        if min(self.nodes, self.per_node) < 1:
            raise ValueError(BAD_TOPOLOGY.format(nodes=self.nodes, per_node=self.per_node))

    @property
    def world(self) -> int:
        """The number of ranks ``W``."""
        return self.nodes * self.per_node

    def shard_inside_node(self, size: int) -> bool:
        """Whether every group of ``size`` contiguous ranks stays on one node."""
        return size <= self.per_node and self.per_node % size == 0

    def check_shard(self, size: int) -> None:
        """Raise :data:`BAD_SHARD` unless ``size`` divides the world."""
        if size < 1 or self.world % size:
            raise ValueError(
                BAD_SHARD.format(
                    size=size, world=self.world, nodes=self.nodes, per_node=self.per_node
                )
            )


@dataclass(frozen=True)
class ScaleRow:
    """One stage at one topology: bytes held by the most loaded rank, bytes one rank sends
    per step over intra-node and inter-node links.

    Attributes:
        stage: see the module doc.
        rule: the partition rule (``-`` for DDP and FSDP).
        shard: the ranks the optimizer state is sharded over (1: replicated).
        params, grads, state: bytes per rank (parameters, gradients, optimizer state).
        intra, inter: bytes one rank sends per step, by link.
    """

    stage: str
    rule: str
    shard: int
    params: int
    grads: int
    state: int
    intra: float
    inter: float

    def as_dict(self) -> dict[str, Any]:
        """Return the row as plain JSON data."""
        return dataclasses.asdict(self)


def ring_bytes(kind: str, ranks: int, size: float) -> float:
    """Bytes one rank sends in the ring algorithm of ``kind`` over ``ranks`` (module doc).

    Example:
        >>> ring_bytes("all_reduce", 4, 100), ring_bytes("reduce_scatter", 4, 100)
        (150.0, 75.0)
    """
    share = (ranks - 1) / ranks * size
    return 2 * share if kind == "all_reduce" else share


def rank_loads(
    specs: Sequence[ParamSpec], world: int, rule: Rule | str, align: int = FLAT_ALIGN
) -> list[int]:
    """Trainable elements of every rank under ``rule`` (one param group; under the flat rule
    every spec gets ``align`` and the one key :data:`FLAT_KEY`).

    Example:
        >>> rank_loads([ParamSpec(10), ParamSpec(6)], 2, "torch")
        [10, 6]
    """
    return [sum(numels) for numels in rank_numels(specs, world, rule, align)]


def rank_numels(
    specs: Sequence[ParamSpec], world: int, rule: Rule | str, align: int = FLAT_ALIGN
) -> list[list[int]]:
    """Per rank, the element counts of the trainable tensors its inner optimizer steps (whole
    params, or their pieces under the flat rule), as :func:`rank_loads` plans them.

    Example:
        >>> rank_numels([ParamSpec(10), ParamSpec(6), ParamSpec(4)], 2, "fairscale")
        [[10], [6, 4]]
    """
    rule = Rule(rule)
    if rule is Rule.FLAT:
        specs = [dataclasses.replace(s, key=FLAT_KEY, align=align) for s in specs]
    plan = make_plan([list(specs)], world, ShardPolicy(rule=rule))
    numels: list[list[int]] = [[] for _ in range(world)]
    for piece in sorted(plan.pieces, key=lambda p: (p.owner, p.index)):
        if plan.trainable[piece.index] and piece.numel:
            numels[piece.owner].append(piece.numel)
    return numels


def _sync_bytes(loads: Sequence[int], width: int, nccl: bool) -> float:
    """Bytes one rank sends in the parameter sync over ``len(loads)`` ranks."""
    ranks = len(loads)
    if ranks == 1:
        return 0.0
    broadcast, gather = owner_key_elements(loads, 1, ranks)
    if nccl and auto_gathers(broadcast * width, gather * width, ranks):
        return (ranks - 1) * gather / ranks * width
    return ring_bytes("broadcast", ranks, broadcast * width)


def scale_rows(
    specs: Sequence[ParamSpec] | Sequence[int],
    topology: Topology,
    rules: Iterable[Rule | str],
    shard_sizes: Iterable[int],
    width: int = 4,
    state_width: int = 8,
    backend: str = "nccl",
    align: int = FLAT_ALIGN,
    state: OptimizerState | None = None,
) -> list[ScaleRow]:
    """Every stage of the module doc at ``topology``: DDP, then per rule ZeRO-1, ZeRO-2 and
    both hybrids at each shard size, then FSDP ``HYBRID_SHARD`` at each shard size.

    Args:
        specs: the model's params (element counts are read as trainable specs).
        topology: nodes x ranks per node.
        rules: partition rules.
        shard_sizes: the hybrid shard sizes ``S`` (divisors of the world).
        width: bytes per parameter, gradient and wire element (4: fp32).
        state_width: optimizer-state bytes per trainable element (8: Adam's two fp32).
        backend: ``"nccl"`` (the sync's all_gather where ``auto`` picks it) or ``"gloo"``.
        align: the flat rule's alignment.
        state: the optimizer's state layout
            (:data:`~oss_plus.planning.optim_state.OPTIMIZER_STATES`): each rank's state is
            then the sum of its tensors' costs, block scales and fp32 fallbacks included
            (``state_width`` is not used).

    Raises:
        ValueError: a shard size that does not divide the world, an unknown rule.
    """
    specs = [s if isinstance(s, ParamSpec) else ParamSpec(s) for s in specs]
    trainable = sum(s.numel for s in specs if s.trainable)
    total = sum(s.numel for s in specs)
    world, sizes = topology.world, list(shard_sizes)
    for size in sizes:
        topology.check_shard(size)
    nccl = backend == "nccl"
    spans = topology.nodes > 1  # a group over every rank, or over the replicas, crosses nodes

    @functools.cache
    def numels(rule: str, ranks: int) -> list[list[int]]:
        return rank_numels(specs, ranks, rule, align)

    def loads(rule: str, ranks: int) -> list[int]:
        return [sum(n) for n in numels(rule, ranks)]

    def held(rule: str, ranks: int) -> int:
        """The optimizer state of the most loaded rank."""
        if state is None:
            return max(loads(rule, ranks)) * state_width
        return max(state.rank_bytes(n) for n in numels(rule, ranks))

    def row(
        stage: str, rule: str, shard: int, grads: int, state: int, links: list[tuple[bool, float]]
    ) -> ScaleRow:
        intra = sum(b for inside, b in links if inside or not spans)
        inter = sum(b for inside, b in links if not inside and spans)
        return ScaleRow(stage, rule, shard, total * width, grads, state, intra, inter)

    grads = trainable * width
    all_reduce = (False, ring_bytes("all_reduce", world, grads))
    rows = [row("ddp", "-", 1, grads, held(Rule.FAIRSCALE.value, 1), [all_reduce])]
    for rule in (Rule(r).value for r in rules):
        most, kept = max(loads(rule, world)), held(rule, world)
        sync = (False, _sync_bytes(loads(rule, world), width, nccl))
        rows.append(row("zero1", rule, world, grads, kept, [all_reduce, sync]))
        reduce = (False, ring_bytes("reduce_scatter", world, grads))
        rows.append(row("zero2", rule, world, most * width, kept, [reduce, sync]))
        for size in sizes:
            inside = topology.shard_inside_node(size)
            most, kept = max(loads(rule, size)), held(rule, size)
            sync = (inside, _sync_bytes(loads(rule, size), width, nccl))
            rows.append(row("hybrid-zero1", rule, size, grads, kept, [all_reduce, sync]))
            reduce = (inside, ring_bytes("reduce_scatter", size, grads))
            replicas = (False, ring_bytes("all_reduce", world // size, most * width))
            links = [reduce, replicas, sync]
            rows.append(row("hybrid-zero2", rule, size, most * width, kept, links))
    for size in sizes:
        fsdp = _fsdp_hybrid(topology, size, trainable, total, width, state_width)
        if state is not None:  # FSDP2 shards every param on dim 0: about numel / S each
            pieces = [-(-s.numel // size) for s in specs if s.trainable and s.numel]
            fsdp = dataclasses.replace(fsdp, state=state.rank_bytes(pieces))
        rows.append(fsdp)
    return rows


def _fsdp_hybrid(
    topology: Topology, size: int, trainable: int, total: int, width: int, state_width: int
) -> ScaleRow:
    """FSDP ``HYBRID_SHARD`` at shard size ``size`` (flat shards of ``ceil(P / S)``)."""
    spans = topology.nodes > 1
    inside = topology.shard_inside_node(size) or not spans
    shard = -(-trainable // size)
    gathers = 2 * ring_bytes("all_gather", size, total * width)  # forward, and backward
    on_shard = gathers + ring_bytes("reduce_scatter", size, trainable * width)
    replicas = ring_bytes("all_reduce", topology.world // size, shard * width)
    intra = (on_shard if inside else 0.0) + (0.0 if spans else replicas)
    inter = (0.0 if inside else on_shard) + (replicas if spans else 0.0)
    params = -(-total // size) * width
    return ScaleRow(
        "fsdp-hybrid", "-", size, params, shard * width, shard * state_width, intra, inter
    )
