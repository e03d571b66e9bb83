"""The inner optimizer's extras in torch's DCP flow (:mod:`oss_plus.state.dcp`).

What an inner optimizer's ``state_dict()`` holds beyond per-param state and param groups
(:mod:`oss_plus.state.extras`) travels, checked to be the same on every rank
(:mod:`oss_plus.state.agreement`), in the first param group handed to torch, under
:data:`~oss_plus.state.dcp_form.EXTRAS_KEY`, as one int (its JSON description), which DCP
saves as a plain value and sets whole at a load. The per-param entries of a nested part ride
in the param's state like any other entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oss_plus.runtime import dist as _dist
from oss_plus.state.agreement import check_agreed, digest_of
from oss_plus.state.dcp_form import EXTRAS_KEY, extras_from_number, extras_to_number
from oss_plus.state.extras import Extras, storable

__all__ = ["EXTRAS_KEY", "FLAT_EXTRAS", "agreed_extras", "put_extras", "taken_extras"]

#: Raised under ``flatten_optimizer_state_dict=True`` for an optimizer with extras other
#: than those it builds (its configuration, which a loading optimizer builds too).
FLAT_EXTRAS = (
    "{name}'s state_dict() holds more than per-param state and param groups ({keys}), and "
    "torch's flatten_optimizer_state_dict=True rebuilds only the keys of the live param "
    "groups and state: it would be lost. Use the default StateDictOptions (or "
    "full_state_dict=True), or oss_plus.checkpoint.save_checkpoint"
)


def agreed_extras(optimizer: Any, flat: bool) -> Extras | None:
    """This rank's extras (:mod:`oss_plus.state.extras`), checked to be every rank's.

    Raises:
        ValueError: the ranks differ (:data:`oss_plus.state.agreement.RANKS_DIFFER`), or
            ``flat`` with extras (:data:`FLAT_EXTRAS`); on every rank.

    .. warning:: Collective: call on every rank of the optimizer's group.
    """
    shard = optimizer.local_shard
    extras = _dist.run_phase(shard.extras, optimizer.group)
    what = "torch.distributed.checkpoint's get_state_dict"
    check_agreed(extras, optimizer.param_groups, shard.built_groups, optimizer.group, what)
    if not flat or extras is None:
        return extras

    def as_built() -> None:  # configuration the loading optimizer builds itself may stay
        if extras.parts or digest_of(extras.to_value()) != shard.built_extras:
            name = type(optimizer.optim).__qualname__
            raise ValueError(FLAT_EXTRAS.format(name=name, keys=", ".join(extras.names())))

    _dist.run_phase(as_built, optimizer.group)
    return None


def put_extras(groups: list[dict[str, Any]], extras: Extras | None) -> None:
    """Hand ``extras`` to DCP in the first param group (:data:`EXTRAS_KEY`), without what
    has no JSON form (:func:`oss_plus.state.extras.storable`)."""
    kept = storable(extras, "torch.distributed.checkpoint")
    if kept is not None and groups:
        groups[0][EXTRAS_KEY] = extras_to_number(kept.to_value(), "optimizer extras")


def taken_extras(groups: Sequence[Any]) -> Extras | None:
    """The extras :func:`put_extras` handed to DCP, from the groups a load gives back."""
    number = groups[0].get(EXTRAS_KEY) if groups else None
    if number is None:
        return None
    return Extras.from_value(extras_from_number(number, "param_groups[0]"))
