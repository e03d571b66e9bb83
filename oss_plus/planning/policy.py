"""The policy adapters customise the core with: a frozen :class:`ShardPolicy` (PURE).

The core, the fairscale adapter and the torch adapter differ in a small set of choices: the
partition rule, the order of each rank's inner optimizer (:class:`LocalOrder`), the layout
of the parameter-sync buckets (:class:`Layout`), alignment and transport. A policy holds
them, validated on construction; adapters pass one instead of overriding private methods.
:func:`oss_plus.planning.plan.make_plan` partitions by it, and :mod:`oss_plus.planning.plan`
re-exports these names; the public path is :mod:`oss_plus.planning`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from oss_plus.planning.partition import ParamSpec, Rule

__all__ = ["BAD_POLICY", "Layout", "LocalOrder", "ShardPolicy"]


class Transport(str, enum.Enum):
    """How buckets travel from their owner to the other ranks (see :mod:`oss_plus.wire.sync`)."""

    AUTO = "auto"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"


class LocalOrder(str, enum.Enum):
    """The order of one group's params inside a rank's inner optimizer.

    * ``largest_first`` (the core's): stable by decreasing size. Elementwise optimizers give
      the same values in any order; the order changes how the allocator reuses the step's
      temporaries. Measured on CPU (glibc, 20M-param Adam): a weight/bias/weight/bias order
      costs 50% more page faults per step and a 25% slower local step than params grouped
      by size (``docs/performance.md``).
    * ``rule``: the order the partition rule visits them (fairscale: as given).
    """

    LARGEST_FIRST = "largest_first"
    RULE = "rule"


class Layout(str, enum.Enum):
    """How parameters are laid out for the sync after the local step.

    * ``owner_buckets``: per (device, dtype, owner) one flat buffer of the owner's trainable
      params in ascending size; params are views into it (the core's and fairscale's).
    * ``ordered_buckets``: the same, params in the owner's local order (torch ZeRO's
      ``parameters_as_bucket_view=True``).
    * ``per_param``: every param (frozen ones too) broadcast from its own storage (torch
      ZeRO's default).
    """

    OWNER_BUCKETS = "owner_buckets"
    ORDERED_BUCKETS = "ordered_buckets"
    PER_PARAM = "per_param"


#: Raised for a policy field of the wrong kind.
BAD_POLICY = "ShardPolicy.{field} must be one of {allowed}, got {value!r}"


@dataclass(frozen=True)
class ShardPolicy:
    """The choices in which the core and the adapters differ (validated on construction).

    Attributes:
        rule: the partition rule (:class:`~oss_plus.planning.partition.Rule` or its value).
        local_order: :class:`LocalOrder` of each rank's inner optimizer.
        layout: :class:`Layout` of the sync buckets.
        aligned: start every bucketed param at an allocator-aligned offset (the core's;
            bit-identical to the unsharded optimizer) or back to back (fairscale's, torch's).
        transport: ``auto``, ``broadcast`` or ``all_gather`` (see :mod:`oss_plus.wire.sync`).
        single_rank_layout: lay the buckets out at world size 1 too, where nothing travels
            (default False: params keep their own storage). The adapters set it so that params
            sit where fairscale and torch ZeRO put them (their layouts change a forward's
            rounding).

    Example:
        >>> ShardPolicy(rule="torch").rule
        <Rule.TORCH: 'torch'>
    """

    rule: Rule = Rule.FAIRSCALE
    local_order: LocalOrder = LocalOrder.LARGEST_FIRST
    layout: Layout = Layout.OWNER_BUCKETS
    aligned: bool = True
    transport: Transport = Transport.AUTO
    single_rank_layout: bool = False

    def __post_init__(self) -> None:
        for name, kind in (
            ("rule", Rule),
            ("local_order", LocalOrder),
            ("layout", Layout),
            ("transport", Transport),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = [m.value for m in kind]
                raise ValueError(
                    BAD_POLICY.format(field=name, allowed=allowed, value=value)
                ) from None
        for flag in ("aligned", "single_rank_layout"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"ShardPolicy.{flag} must be a bool, got {getattr(self, flag)!r}")

    def local_orders(self, groups: Sequence[Sequence[ParamSpec]]) -> list[list[int]]:
        """Return, per group, the order of its params in an inner optimizer."""
        if self.local_order is LocalOrder.RULE:
            return [self.rule.order(specs) for specs in groups]
        return [sorted(range(len(specs)), key=lambda i: -specs[i].numel) for specs in groups]
