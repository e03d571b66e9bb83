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

from oss_plus.planning.policy import Transport

# LAUNCH_BYTES: also for the 0.2 path oss_plus.transport.LAUNCH_BYTES (oss_plus._moved), until 0.4
from oss_plus.planning.transport import LAUNCH_BYTES, auto_gathers, owner_key_elements
from oss_plus.wire.layout import Key, alignment, bucket_numel

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
        aligned: the layout aligns every param (as :func:`oss_plus.wire.layout.owner_buckets`).
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
