"""Which transport the parameter sync's buckets use (chosen once per layout, the same on every
rank), and the environment override of the automatic choice.

* ``broadcast``: one async broadcast per bucket from its owner. Works everywhere.
* ``all_gather``: per (device, dtype) one flat buffer with an equal, padded region per rank
  (the buckets are views of it) and one ``all_gather_single`` per buffer. The default for CUDA
  buckets on NCCL (one collective per dtype instead of one per rank). Slow on gloo.

``transport="auto"`` picks the defaults above; the environment variable :data:`TRANSPORT_ENV`
overrides ``auto`` (set it identically on every rank). :func:`wire_dtype_for` says which
buffers a compressed wire narrows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oss_plus._layout import Key, Transport

__all__ = [
    "BAD_TRANSPORT",
    "TRANSPORT_ENV",
    "Transport",
    "gathered_keys",
    "requested",
    "transport_override",
    "wire_dtype_for",
]

#: Environment variable overriding ``transport="auto"``: broadcast or all_gather.
TRANSPORT_ENV = "OSS_PLUS_SYNC"
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
    params_by_owner: Sequence[Sequence[torch.Tensor]], transport: Transport | str, group: Any
) -> list[Key]:
    """Return the (device, dtype) keys whose buckets travel by ``all_gather``.

    Raises:
        ValueError: unknown ``transport`` (or value of :data:`TRANSPORT_ENV`).
    """
    chosen = requested(transport)
    keys = list(
        dict.fromkeys(
            (str(p.device), p.dtype) for ps in params_by_owner for p in ps if p.requires_grad
        )
    )
    if chosen is Transport.ALL_GATHER:
        return keys
    world = dist.get_world_size(group)
    if chosen is Transport.AUTO and world > 1 and "nccl" in _backend(group):
        return [k for k in keys if not k[0].startswith("cpu")]
    return []


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
