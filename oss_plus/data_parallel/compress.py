"""How a gradient enters and leaves a reduce buffer: pre-division, optional fp16/bf16 wire.

Uncompressed, a bucket's gradients are multiplied by ``1 / world_size`` in the buffer just
before it is sent (elementwise the same rounding as DDP's reducer,
``mul_out(bucket_view, grad, 1 / world_size)``), so the sum received by the owner is the
average. Compressed, they are cast to the wire dtype first and divided there, as
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``'s ``fp16_compress_hook`` /
``bf16_compress_hook`` do; the owner widens the sum back into the param's dtype. Only
floating gradients wider than the wire dtype are compressed.
"""

from __future__ import annotations

import torch

from oss_plus.wire.sync import wire_dtype_for

__all__ = ["BAD_REDUCE_DTYPE", "buffer_dtype", "resolve_wire"]

#: The wire dtypes gradients may travel as.
WIRE_DTYPES = (torch.float16, torch.bfloat16)

#: Raised for a wire dtype that is not fp16/bf16.
BAD_REDUCE_DTYPE = (
    "reduce_dtype must be torch.float16, torch.bfloat16 or None, got {value!r}; pass "
    "reduce_fp16=True for fp16 or reduce_dtype=torch.bfloat16 for bf16"
)


def resolve_wire(reduce_fp16: bool, reduce_dtype: torch.dtype | None) -> torch.dtype | None:
    """Return the wire dtype asked for (``reduce_fp16`` wins), or None for no compression.

    Raises:
        ValueError: ``reduce_dtype`` is not fp16, bf16 or None.
    """
    if reduce_dtype is not None and reduce_dtype not in WIRE_DTYPES:
        raise ValueError(BAD_REDUCE_DTYPE.format(value=reduce_dtype))
    return torch.float16 if reduce_fp16 else reduce_dtype


def buffer_dtype(param_dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    """The dtype of the reduce buffer for gradients of ``param_dtype``.

    Example:
        >>> buffer_dtype(torch.float32, torch.bfloat16), buffer_dtype(torch.float16, torch.bfloat16)
        (torch.bfloat16, torch.float16)
    """
    return wire_dtype_for(param_dtype, wire) or param_dtype
