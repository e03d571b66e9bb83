"""The rule behind ``transport="auto"`` (PURE): what one sync of a key moves by per-owner
``broadcast`` and by ``all_gather``, and which of the two NCCL gets. :mod:`oss_plus.wire.transport`
applies it to a layout's buckets; :mod:`oss_plus.planning.scale` to a model's plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from oss_plus.planning.partition import padded

__all__ = ["LAUNCH_BYTES", "auto_gathers", "owner_key_elements"]

#: What one collective launch is worth in bytes: an ``all_gather`` may move this much more
#: than the broadcasts for each of the ``W - 1`` broadcasts it saves (NCCL launches cost
#: 10-20 us each, 0.5-1 MB at 25-50 GB/s per GPU; not measured here, no GPU).
LAUNCH_BYTES = 2**19


def owner_key_elements(numels: Sequence[int], align: int, world: int) -> tuple[int, int]:
    """Return the elements one sync of a key moves by per-owner ``broadcast`` and by
    ``all_gather`` (PURE), given each owner's bucket of the key (alignment padding
    included; 0 for an owner without params of the key), as
    :func:`oss_plus.wire.layout.owner_buckets` lays them out: a broadcast bucket carries its
    params and a status slot; every ``all_gather`` region is the largest bucket plus its
    slot, rounded up to ``align``.

    Example:
        >>> owner_key_elements([1000, 10, 0, 0], align=16, world=4)  # one large tensor
        (1012, 4032)
        >>> owner_key_elements([512, 496], align=16, world=2)
        (1010, 1056)
    """
    broadcast = sum(n + 1 for n in numels if n)
    return broadcast, world * padded(max(numels, default=0) + 1, align)


def auto_gathers(broadcast_bytes: int, gather_bytes: int, world: int) -> bool:
    """NCCL's ``transport="auto"`` rule for one key (PURE): ``all_gather`` unless it moves
    more than the broadcasts plus :data:`LAUNCH_BYTES` per broadcast it saves.

    Example:
        >>> auto_gathers(4 * 1012, 4 * 4032, world=4), auto_gathers(2**30, 2**30 + 2**19, 2)
        (True, True)
        >>> auto_gathers(5_200_000_000, 64 * 320_000_000, world=64)  # an 80M embedding
        False
    """
    return gather_bytes <= broadcast_bytes + (world - 1) * LAUNCH_BYTES
