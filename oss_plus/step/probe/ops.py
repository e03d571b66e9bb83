"""What the trace needs to know of an aten op: its tensor arguments, which it writes, whether
it is elementwise, reads shapes only, or draws random numbers (from its schema and tags)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Arg", "OpInfo", "op_info", "tensors"]

#: In-place ops whose result does not depend on the tensor they write.
_OVERWRITE = frozenset(
    {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
     "cauchy_", "log_normal_", "geometric_", "set_", "resize_", "_foreach_copy_", "_foreach_zero_"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Arg:
    position: int
    name: str
    is_list: bool
    written: bool


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str
    args: tuple[Arg, ...]
    overwrite: bool
    shape_only: bool
    seeded: bool
    pointwise: bool


#: Ops whose every output element comes from the same element of each input (broadcast),
#: besides those torch tags ``pointwise``.
_ELEMENTWISE = frozenset(
    {"copy_", "fill_", "zero_", "clone", "_to_copy", "lift_fresh", "lift_fresh_copy",
     "masked_fill", "masked_fill_", "contiguous"}
)  # fmt: skip
#: ``_foreach_*`` ops that are not elementwise per tensor.
_FOREACH_REDUCING = frozenset({"_foreach_norm", "_foreach_max"})


@functools.cache
def op_info(func: Any) -> OpInfo:
    schema = func._schema
    args = []
    for i, a in enumerate(schema.arguments):
        text = str(a.type)
        if "Tensor" not in text:
            continue
        written = a.alias_info is not None and a.alias_info.is_write
        args.append(Arg(i, a.name, "List[" in text, written))
    base = schema.name.split("::")[-1]
    out_variant = any(a.written and a.name.startswith("out") for a in args) or (
        func._overloadname.startswith("out")
    )
    foreach = base.startswith(("_foreach_", "_fused_"))
    pointwise = (
        torch.Tag.pointwise in func.tags
        or base in _ELEMENTWISE
        or (foreach and base.rstrip("_") not in _FOREACH_REDUCING)
    )
    return OpInfo(
        name=f"aten.{base}",
        args=tuple(args),
        overwrite=base in _OVERWRITE or out_variant,
        shape_only=base.endswith("_like") or base.startswith("new_"),
        seeded=torch.Tag.nondeterministic_seeded in func.tags,
        pointwise=pointwise,
    )


def tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors(v)
