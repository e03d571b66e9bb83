"""Which transport the parameter sync's buckets use (chosen once per layout, the same on every
rank), and the environment override of the automatic choice.

* ``broadcast``: one async broadcast per bucket from its owner. Works everywhere.
* ``all_gather``: per (device, dtype) one flat buffer with an equal, padded region per rank
  (the buckets are views of it) and one ``all_gather_single`` per buffer: one collective per
  dtype instead of one per rank, but every rank's region is as large as the largest rank's
  share, so the wire carries ``W x region``, not the total. Slow on gloo.

``transport="auto"`` picks per (device, dtype) key, from the params' sizes alone, so every
rank picks the same (:func:`auto_gathers`):

* gloo (and any backend outside :data:`GATHER_BACKENDS`): ``broadcast``. An ``all_gather``
  never moves fewer bytes (``W x region >= total``) and gloo's is 3-5x slower per byte
  (docs/performance.md);
* NCCL, CUDA keys: ``all_gather`` when its ``W x region`` elements exceed the per-owner
  broadcasts' total by at most :data:`LAUNCH_BYTES` per broadcast it saves, else
  ``broadcast``. Under the flat rule every region is ``1/W`` of the key, so it gathers; under a
  whole-param rule a key dominated by one large tensor (an embedding at 64 ranks) is
  broadcast, which moves its total instead of ``W`` times its largest share.

The environment variable :data:`TRANSPORT_ENV` overrides ``auto`` (set it identically on every
rank). :func:`wire_dtype_for` says which buffers a compressed wire narrows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._layout import Key, Transport, alignment, bucket_numel, padded

__all__ = [
    "BAD_TRANSPORT",
    "GATHER_BACKENDS",
    "LAUNCH_BYTES",
    "TRANSPORT_ENV",
    "Transport",
    "auto_gathers",
    "owner_key_elements",
    "gathered_keys",
    "requested",
    "transport_override",
    "wire_dtype_for",
]

#: Environment variable overriding ``transport="auto"``: broadcast or all_gather.
TRANSPORT_ENV = "OSS_PLUS_SYNC"
#: The backends on which ``transport="auto"`` considers ``all_gather`` (gloo's is 3-5x slower
#: per byte than its broadcasts, docs/performance.md).
GATHER_BACKENDS = ("nccl",)
#: What one collective launch is worth in bytes: an ``all_gather`` may move this much more
#: than the broadcasts for each of the ``W - 1`` broadcasts it saves (NCCL launches cost
#: 10-20 us each, 0.5-1 MB at 25-50 GB/s per GPU; not measured here, no GPU).
LAUNCH_BYTES = 2**19
#: Raised for an unknown transport name.
BAD_TRANSPORT = "{where} must be one of 'auto', 'broadcast' or 'all_gather', got {value!r}"


def requested(transport: Transport | str) -> Transport:
    """Return the transport asked for: ``transport``, or :data:`TRANSPORT_ENV` for ``auto``.

    Raises:
        ValueError: an unknown name (argument or environment variable).

    Example:
        >>> requested("broadcast")
        <Transport.BROADCAST: 'broadcast'>
    """
    try:
        value = Transport(transport)
    except ValueError:
        raise ValueError(BAD_TRANSPORT.format(where="transport", value=transport)) from None
    env = os.environ.get(TRANSPORT_ENV, "")
    if value is Transport.AUTO and env:
        try:
            value = Transport(env)
        except ValueError:
            raise ValueError(BAD_TRANSPORT.format(where=TRANSPORT_ENV, value=env)) from None
    return value


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def owner_key_elements(numels: Sequence[int], align: int, world: int) -> tuple[int, int]:
    """Return the elements one sync of a key moves by per-owner ``broadcast`` and by
    ``all_gather`` (PURE), given each owner's bucket of the key (alignment padding
    included; 0 for an owner without params of the key), as :func:`oss_plus._layout.owner_buckets`
    lays them out: a broadcast bucket carries its params and a status slot; every
    ``all_gather`` region is the largest bucket plus its slot, rounded up to ``align``.

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


def gathered_keys(
    params_by_owner: Sequence[Sequence[torch.Tensor]],
    transport: Transport | str,
    group: Any,
    aligned: bool = True,
    equal_regions: bool = False,
) -> list[Key]:
    """Return the (device, dtype) keys whose buckets travel by ``all_gather`` (module doc).

    Args:
        params_by_owner: for every group-local rank, the params it owns.
        transport: the policy's transport.
        group: the process group.
        aligned: the layout aligns every param (as :func:`oss_plus._layout.owner_buckets`).
        equal_regions: the layout gives every rank an equal share of each key (the flat
            rule, ``params_by_owner`` holding all params once): ``all_gather`` moves no more
            than the broadcasts, so ``auto`` on NCCL gathers every CUDA key.

    Raises:
        ValueError: unknown ``transport`` (or value of :data:`TRANSPORT_ENV`).
    """
    chosen = requested(transport)
    by_key: dict[Key, list[list[torch.Tensor]]] = {}
    for owner, params in enumerate(params_by_owner):
        for p in params:
            if p.requires_grad:
                lists = by_key.setdefault((str(p.device), p.dtype), [])
                lists.extend([] for _ in range(owner + 1 - len(lists)))
                lists[owner].append(p)
    if chosen is Transport.ALL_GATHER:
        return list(by_key)
    world = dist.get_world_size(group)
    backend = _backend(group)
    if chosen is not Transport.AUTO or world == 1 or backend not in GATHER_BACKENDS:
        return []
    keys = [k for k in by_key if not (backend == "nccl" and k[0].startswith("cpu"))]
    if equal_regions:
        return keys
    return [k for k in keys if _gather_pays(by_key[k], k, world, aligned)]


def _gather_pays(owned: list[list[torch.Tensor]], key: Key, world: int, aligned: bool) -> bool:
    align = alignment(torch.device(key[0]), key[1]) if aligned else 1
    numels = [bucket_numel(ps, aligned) for ps in owned]
    broadcast, gather = owner_key_elements(numels, align, world)
    return auto_gathers(broadcast * key[1].itemsize, gather * key[1].itemsize, world)


@contextlib.contextmanager
def transport_override(name: str | None) -> Iterator[None]:
    """Within the block, ``transport="auto"`` means ``name`` (:data:`TRANSPORT_ENV`; None:
    as configured). Syncs built inside keep their transport after the block.

    Example:
        >>> with transport_override("all_gather"):  # doctest: +SKIP
        ...     opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
    """
    saved = os.environ.get(TRANSPORT_ENV)
    if name is not None:
        os.environ[TRANSPORT_ENV] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(TRANSPORT_ENV, None)
        else:
            os.environ[TRANSPORT_ENV] = saved


def wire_dtype_for(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype | None:
    """Return the dtype a buffer of ``dtype`` travels as, or None when it goes uncompressed.

    Only floating dtypes wider than ``wire`` are compressed: bf16/fp16 params are never
    upcast, integer params are never touched.

    Example:
        >>> wire_dtype_for(torch.float32, torch.bfloat16)
        torch.bfloat16
        >>> wire_dtype_for(torch.bfloat16, torch.float16) is None
        True
    """
    if wire is None or not dtype.is_floating_point or dtype.itemsize <= wire.itemsize:
        return None
    return wire
