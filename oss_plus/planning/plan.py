"""The shard plan as a value (PURE).

A :class:`ShardPlan` says, for a given list of param groups and world size, which rank owns
every parameter and in which order each rank's inner optimizer holds its own. It is built
by :func:`make_plan` from plain data (:class:`~oss_plus.planning.partition.ParamSpec` per param) and
a :class:`ShardPolicy` (:mod:`oss_plus.planning.policy`, re-exported here: the choices in which the
core and the adapters differ), is frozen, and is what :class:`oss_plus.OSS` exposes to its
collaborators (checkpoints, overlap, gradient sharding) as :attr:`oss_plus.OSS.plan`.

Vocabulary (see :mod:`oss_plus.state.index`): the **flat index** of a param is its position in the
concatenated global groups; a rank's **local view** lists, per group, the flat indices it
owns in the order its inner optimizer holds them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from oss_plus.planning.partition import (
    ParamPos,
    ParamSpec,
    Piece,
    Rule,
    assign_owners,
    cut_flat,
    group_offsets,
    local_view,
    piece_loads,
)
from oss_plus.planning.policy import Layout, LocalOrder, ShardPolicy

__all__ = ["Layout", "LocalOrder", "Piece", "ShardPlan", "ShardPolicy", "make_plan"]


#: Raised for a plan that does not fit an optimizer's param groups.
PLAN_MISMATCH = (
    "the shard plan is for param groups of sizes {given} over {world} ranks, but the optimizer "
    "has groups of sizes {actual} over {ours} ranks: build the plan from this optimizer's "
    "param groups (oss_plus.planning.plan.make_plan)"
)


@dataclass(frozen=True)
class ShardPlan:
    """Who owns every parameter (or every piece of one), and each rank's local view (a
    frozen value).

    One plan type for every rule: the plan is a list of :class:`Piece` s ``(index, start,
    end, owner)``. Under the whole-tensor rules (fairscale's, torch's) every param is one
    piece; under :attr:`~oss_plus.planning.partition.Rule.FLAT` a param may be cut into pieces owned
    by several ranks (:attr:`split`), each rank holding at most one piece of it.

    Attributes:
        world_size: number of ranks.
        rule: the partition rule the owners came from.
        group_sizes: number of params in every global group.
        owners: by flat index, the owner (group-local rank) of every param; of a split
            param, the owner of its first piece.
        local: ``local[rank][g]``: the flat indices of group ``g`` of which ``rank`` owns the
            param or a piece, in the order its inner optimizer holds them.
        numels: element count of every param, by flat index.
        trainable: whether every param required a gradient when the plan was made.
        pieces: every piece, sorted by ``(index, start)`` (default: every param whole, owned
            by ``owners``).

    Raises:
        ValueError: inconsistent fields (pieces that do not cover a param, a rank's view that
            is not exactly what it owns).

    Example:
        >>> plan = make_plan([[ParamSpec(10), ParamSpec(3), ParamSpec(4)]], 2)
        >>> plan.owners, plan.owned(1), plan.local_indices(1), plan.rank_loads()
        ((0, 1, 1), [1, 2], [[2, 1]], [10, 7])
        >>> make_plan([[ParamSpec(10), ParamSpec(6)]], 2, ShardPolicy("flat")).rank_loads()
        [8, 8]
    """

    world_size: int
    rule: Rule
    group_sizes: tuple[int, ...]
    owners: tuple[int, ...]
    local: tuple[tuple[tuple[int, ...], ...], ...]
    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    pieces: tuple[Piece, ...] = ()

    def __post_init__(self) -> None:
        n = sum(self.group_sizes)
        if not len(self.owners) == len(self.numels) == len(self.trainable) == n:
            raise ValueError(
                f"ShardPlan: {n} params in the groups but {len(self.owners)} owners, "
                f"{len(self.numels)} sizes and {len(self.trainable)} trainable flags"
            )
        if not self.pieces:
            whole = tuple(Piece(i, 0, self.numels[i], o) for i, o in enumerate(self.owners))
            object.__setattr__(self, "pieces", whole)
        self._check_pieces()
        if len(self.local) != self.world_size:
            raise ValueError(
                f"ShardPlan: {len(self.local)} local views for world size {self.world_size}"
            )
        for rank, view in enumerate(self.local):
            mine = sorted(i for group in view for i in group)
            if mine != self.owned(rank) or len(view) != len(self.group_sizes):
                raise ValueError(
                    f"ShardPlan: the local view of rank {rank} lists {mine}, but it owns "
                    f"{self.owned(rank)} (one list per group expected)"
                )

    def _check_pieces(self) -> None:
        at = [0] * len(self.numels)
        for piece in self.pieces:
            i = piece.index
            known = 0 <= i < len(at)
            if not (known and piece.start == at[i] and 0 <= piece.owner < self.world_size):
                where = at[i] if known else "?"
                raise ValueError(f"ShardPlan: {piece} does not continue param {i} at {where}")
            at[i] = piece.end
        bad = [i for i, (end, n) in enumerate(zip(at, self.numels)) if end != n]
        if bad:
            raise ValueError(f"ShardPlan: the pieces of params {bad[:5]} do not cover them")
        leads = {p.index: p.owner for p in reversed(self.pieces)}
        if tuple(leads[i] for i in range(len(self.owners))) != self.owners:
            raise ValueError("ShardPlan: owners must be the owner of every param's first piece")

    @functools.cached_property
    def _by_rank(self) -> tuple[dict[int, Piece], ...]:
        mine: tuple[dict[int, Piece], ...] = tuple({} for _ in range(self.world_size))
        for piece in self.pieces:
            mine[piece.owner][piece.index] = piece
        return mine

    @functools.cached_property
    def split(self) -> frozenset[int]:
        """The flat indices of the params cut into more than one piece."""
        return frozenset(p.index for p in self.pieces if p.numel != self.numels[p.index])

    def piece(self, rank: int, index: int) -> Piece | None:
        """Return the piece of param ``index`` that ``rank`` owns (None: no piece)."""
        return self._by_rank[rank].get(index)

    def pieces_of(self, index: int) -> list[Piece]:
        """Return the pieces of param ``index``, in order."""
        return list(self.by_index.get(index, ()))

    def fingerprint(self) -> int:
        """A 63-bit hash of the plan, equal on every process for equal plans (not Python's
        ``hash``, which varies between processes for the rule's string)."""
        pieces = tuple((p.index, p.start, p.end, p.owner) for p in self.pieces)
        fields = (self.world_size, self.rule.value, self.group_sizes, self.owners, self.local)
        text = repr((*fields, self.numels, self.trainable, pieces))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def rank_loads(self) -> list[int]:
        """Return the number of trainable elements every rank owns (its optimizer state).

        Example:
            >>> make_plan([[ParamSpec(10), ParamSpec(3, trainable=False)]], 2).rank_loads()
            [10, 0]
        """
        return piece_loads(self.pieces, self.trainable, self.world_size)

    @property
    def num_params(self) -> int:
        """The number of params over all groups."""
        return len(self.owners)

    def owners_by_group(self) -> list[list[int]]:
        """Return ``owners[g][i]``, the owner of param ``i`` of group ``g``."""
        offsets = group_offsets(self.group_sizes)
        return [list(self.owners[o : o + s]) for o, s in zip(offsets, self.group_sizes)]

    def owned(self, rank: int) -> list[int]:
        """Return the flat indices ``rank`` owns (the param or a piece of it), in flat order."""
        return sorted(self._by_rank[rank])

    def local_indices(self, rank: int) -> list[list[int]]:
        """Return ``rank``'s local view: per group, its flat indices in inner order."""
        return [list(group) for group in self.local[rank]]

    def check_fits(self, group_sizes: Sequence[int], world_size: int) -> None:
        """Raise ValueError unless this plan is for ``group_sizes`` params over ``world_size``."""
        if self.group_sizes != tuple(group_sizes) or self.world_size != world_size:
            raise ValueError(
                PLAN_MISMATCH.format(
                    given=list(self.group_sizes),
                    world=self.world_size,
                    actual=list(group_sizes),
                    ours=world_size,
                )
            )

    def moves(self, other: ShardPlan) -> list[tuple[int, int, int]]:
        """Return ``(flat index, old owner, new owner)`` for every param ``other`` moves.

        Raises:
            ValueError: either plan splits params (compare :attr:`pieces` instead).
        """
        if self.split or other.split:
            raise ValueError("ShardPlan.moves: the plans split params; compare their pieces")
        return [(i, a, b) for i, (a, b) in enumerate(zip(self.owners, other.owners)) if a != b]

    def changed(self, other: ShardPlan) -> list[int]:
        """Return the flat indices whose pieces (bounds or owners) differ in ``other`` (a
        param that only one of the plans has counts as changed)."""
        mine, theirs = self.by_index, other.by_index
        return [i for i in range(max(len(mine), len(theirs))) if mine.get(i) != theirs.get(i)]

    @functools.cached_property
    def by_index(self) -> dict[int, list[Piece]]:
        """The pieces of every param, by flat index (read-only: do not modify)."""
        pieces: dict[int, list[Piece]] = {}
        for p in self.pieces:
            pieces.setdefault(p.index, []).append(p)
        return pieces

    def holders(self, indices: Sequence[int]) -> dict[int, list[int]]:
        """Return, for every flat index of ``indices``, the ranks holding a piece of it."""
        return {i: [p.owner for p in self.by_index.get(i, ())] for i in indices}


def make_plan(
    groups: Sequence[Sequence[ParamSpec]],
    world_size: int,
    policy: ShardPolicy | None = None,
    keep: ShardPlan | None = None,
) -> ShardPlan:
    """Partition ``groups`` over ``world_size`` ranks by ``policy`` (PURE).

    Args:
        groups: one :class:`ParamSpec` per param, per global group.
        world_size: number of ranks.
        policy: the partition rule and local order (default :class:`ShardPolicy`).
        keep: a previous plan whose params (the leading ones) keep their owners; new
            params are placed on top of its totals (``add_param_group``).

    Example:
        >>> make_plan([[ParamSpec(3), ParamSpec(10), ParamSpec(4)]], 2, ShardPolicy("torch")).owners
        (1, 0, 1)
    """
    policy = policy or ShardPolicy()
    if policy.rule is Rule.FLAT:  # cut again: ranges move when a group is added
        pieces = cut_flat(groups, world_size)
        sizes = [len(specs) for specs in groups]
        holders: list[list[int]] = [[] for _ in range(sum(sizes))]
        for piece in pieces:
            holders[piece.index].append(piece.owner)
        return _flat_plan(groups, pieces, holders, policy, world_size)
    fixed: dict[ParamPos, int] = {}
    if keep is not None:
        flat = 0
        for g, size in enumerate(len(specs) for specs in groups):
            for i in range(size):
                if flat < keep.num_params:
                    fixed[(g, i)] = keep.owners[flat]
                flat += 1
    owners = assign_owners(groups, world_size, policy.rule, fixed)
    return plan_from_owners(groups, owners, policy.local_orders(groups), world_size, policy.rule)


def plan_from_owners(
    groups: Sequence[Sequence[ParamSpec]],
    owners: Sequence[Sequence[int]],
    orders: Sequence[Sequence[int]],
    world_size: int,
    rule: Rule = Rule.FAIRSCALE,
) -> ShardPlan:
    """Build a plan from given owners (``owners[g][i]``) and per-group local orders (PURE).

    Used by :func:`make_plan` and by code that decides owners itself (the overlap with
    DDP assigns whole DDP buckets).
    """
    return ShardPlan(
        world_size=world_size,
        rule=Rule(rule),
        group_sizes=tuple(len(specs) for specs in groups),
        owners=tuple(o for group in owners for o in group),
        local=tuple(
            tuple(tuple(g) for g in local_view(owners, rank, orders)) for rank in range(world_size)
        ),
        numels=tuple(s.numel for specs in groups for s in specs),
        trainable=tuple(s.trainable for specs in groups for s in specs),
    )


def _flat_plan(
    groups: Sequence[Sequence[ParamSpec]],
    pieces: Sequence[Piece],
    holders: Sequence[Sequence[int]],
    policy: ShardPolicy,
    world_size: int,
) -> ShardPlan:
    orders = policy.local_orders(groups)
    offsets = group_offsets([len(specs) for specs in groups])
    local = tuple(
        tuple(
            tuple(offset + i for i in order if rank in holders[offset + i])
            for offset, order in zip(offsets, orders)
        )
        for rank in range(world_size)
    )
    return ShardPlan(
        world_size=world_size,
        rule=Rule.FLAT,
        group_sizes=tuple(len(specs) for specs in groups),
        owners=tuple(h[0] for h in holders),
        local=local,
        numels=tuple(s.numel for specs in groups for s in specs),
        trainable=tuple(s.trainable for specs in groups for s in specs),
        pieces=tuple(pieces),
    )
