"""What a checkpoint keeps of the inner optimizer's ``state_dict()`` beyond per-param state
and param groups (format version 6, ``docs/checkpoint_format.md``).

The extras (:mod:`oss_plus.state.extras`: extra top-level keys, state not keyed by a param,
what is left of a nested base optimizer's dict) are the index's ``optimizer_extras``,
value-encoded JSON (tensors inline, as in param groups):

* ``{"common": EXTRAS}`` when every rank of the saving group holds the same extras and the
  same param groups: any world size and plan loads it;
* ``{"ranks": [{"extras": EXTRAS or null, "param_groups": [...]}, ...]}``, one per group
  rank, when they differ (dadaptation's ``DAdaptAdam(fsdp_in_use=True)`` keeps its share of
  a sum in its groups): only a sharded save keeps them, and only a load at the same world
  size, rule and partition takes them (each rank its own), exactly; anything else raises
  on every rank before anything is written or loaded.

An index without the key (every ``torch.optim`` class) is written as version 5.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from oss_plus.checkpoint.values import decode_value, encode_value
from oss_plus.runtime.dist import all_gather_bytes, run_phase
from oss_plus.state.agreement import RANKS_DIFFER, compare, raise_differing
from oss_plus.state.extras import Extras, storable
from oss_plus.state.index import own_group_keys, pack_param_groups

__all__ = ["EXTRAS_KEY", "PER_RANK", "check_extras", "for_rank", "gather", "plain_extras"]

#: The index key of the extras.
EXTRAS_KEY = "optimizer_extras"

#: Raised when per-rank values are loaded where they cannot be kept exactly.
PER_RANK = (
    "{where} keeps a value of its own for each of the {saved} ranks that saved it (the "
    "inner optimizer's param groups or state_dict() extras differed between them), so only "
    "the same world size, partition rule and partition can resume it exactly; this optimizer "
    "has {world} ranks, rule {rule!r} and partition {partition}, the checkpoint {saved} "
    "ranks, rule {saved_rule!r} and partition {saved_partition}"
)


def gather(optimizer: Any, sharded: bool) -> dict[str, Any] | None:
    """Every rank's extras and param groups, value-encoded: the index's ``optimizer_extras``
    (None: nothing to keep).

    Raises:
        TypeError: a value cannot be stored (on every rank).
        ValueError: the ranks differ and ``sharded`` is False
            (:data:`oss_plus.state.agreement.RANKS_DIFFER`, on every rank).

    .. warning:: Collective: call on every rank of ``group``.
    """
    group = optimizer.group

    def encode() -> tuple[Extras | None, list[dict[str, Any]], str]:
        extras = storable(optimizer.local_shard.extras(), "save_checkpoint()")
        groups = pack_param_groups(optimizer.param_groups, own_group_keys(optimizer.optim))
        value = None if extras is None else encode_value(extras.to_value(), "optimizer extras")
        encoded = [
            {k: encode_value(v, f"param_groups[{g}][{k!r}]") for k, v in grp.items()}
            for g, grp in enumerate(groups)
        ]
        return extras, groups, json.dumps({"extras": value, "param_groups": encoded})

    extras, groups, mine = run_phase(encode, group)
    names, per_rank = compare(extras, groups, optimizer.local_shard.built_groups, group)
    if not names:  # the values as built may differ (heavyball's param_count): kept as before
        return None if extras is None else {"common": json.loads(mine)["extras"]}
    if not sharded:
        raise_differing(names, per_rank, group, "save_checkpoint(sharded=False)")
    return {"ranks": [json.loads(text) for text in all_gather_bytes(mine.encode(), group)]}


def check_extras(data: Any, version: int, world_size: Any, where: str) -> dict[str, Any] | None:
    """Validate an index's ``optimizer_extras`` (None when absent).

    Raises:
        ValueError: present before version 6, or not of the form above.
    """
    if data is None:
        return None
    if version < 6:
        raise ValueError(f"{where}: {EXTRAS_KEY!r} in a version-{version} index: it is damaged")
    ok = isinstance(data, dict) and (
        set(data) == {"common"}
        or (
            set(data) == {"ranks"}
            and isinstance(data["ranks"], list)
            and len(data["ranks"]) == world_size
            and all(
                isinstance(r, dict) and {"extras", "param_groups"} <= set(r) for r in data["ranks"]
            )
        )
    )
    if not ok:
        raise ValueError(
            f"{where}: {EXTRAS_KEY!r} is neither {{'common': ...}} nor {{'ranks': [...]}} with "
            "one entry per saving rank: the index is damaged; re-save the checkpoint"
        )
    return data


def _decode(value: Any, where: str) -> Extras | None:
    return None if value is None else Extras.from_value(decode_value(value, where))


def for_rank(
    index: Any, optimizer: Any, groups: Sequence[Mapping[str, Any]], where: str
) -> tuple[list[dict[str, Any]], Extras | None]:
    """The param groups and extras this rank loads from ``index``.

    Raises:
        ValueError: per-rank values at another world size, rule or partition
            (:data:`PER_RANK`; every rank computes the same answer).
    """
    data = index.extras
    if data is None:
        return [dict(g) for g in groups], None
    if "common" in data:
        return [dict(g) for g in groups], _decode(data["common"], where)
    plan = optimizer.plan
    partition = plan.owners_by_group()
    if (index.world_size, index.partition_rule, index.partition) != (
        optimizer.world_size,
        plan.rule.value,
        partition,
    ):
        raise ValueError(
            PER_RANK.format(
                where=where,
                saved=index.world_size,
                world=optimizer.world_size,
                rule=plan.rule.value,
                partition=partition,
                saved_rule=index.partition_rule,
                saved_partition=index.partition,
            )
        )
    mine = data["ranks"][optimizer.rank]
    values = [
        {k: decode_value(v, f"{where}: rank {optimizer.rank}'s group {g}") for k, v in grp.items()}
        for g, grp in enumerate(mine["param_groups"])
    ]
    own = [
        {**saved, **{k: v for k, v in given.items() if k != "params"}}
        for saved, given in zip(groups, values)
    ]
    return own, _decode(mine["extras"], where)


def plain_extras(index: Any, where: str) -> Extras | None:
    """The extras a plain state dict of ``index`` carries (:func:`read_state_dict`).

    Raises:
        ValueError: the checkpoint keeps a value per rank, which one dict cannot.
    """
    data = index.extras
    if data is None:
        return None
    if "ranks" in data:
        raise ValueError(
            RANKS_DIFFER.format(
                what=f"read_state_dict({where})",
                items="the param groups or state_dict() extras it keeps per rank",
                values="see the index's 'optimizer_extras'",
            )
        )
    return _decode(data["common"], where)
