"""Validation of ``ZeroRedundancyOptimizer``'s arguments, with the exception types torch raises.

The messages are oss_plus's own (they name the item and the fix); the types (TypeError or
ValueError) are torch's, so code catching torch's exceptions keeps working.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FUNCTIONAL_OPTIMIZER",
    "GROUP_PARAMS_SET",
    "GROUP_WITHOUT_PARAMS",
    "NOT_DENSE",
    "NO_PARAMS",
    "PARAMS_EMPTY",
    "PARAMS_IS_TENSOR",
    "PARAMS_MIXED",
    "PARAMS_NOT_ITERABLE",
    "check_dense",
    "check_optimizer_class",
    "flatten",
    "overlap_optimizer_class",
    "params_as_list",
    "UNKNOWN_OPTIMIZER_NAME",
    "optimizer_names",
    "resolve_optimizer_class",
]


#: Raised for the ``params`` argument, with the exception types torch uses.
PARAMS_IS_TENSOR = (
    "params must be an iterable of tensors or of param-group dicts, got a single {typename}: "
    "wrap it in a list"
)
PARAMS_NOT_ITERABLE = (
    "params must be an iterable of tensors or of param-group dicts, got {typename}"
)
PARAMS_EMPTY = "ZeroRedundancyOptimizer got an empty parameter list: pass model.parameters()"
PARAMS_MIXED = (
    "params must be all tensors or all param-group dicts, got a mix: {kinds}; "
    "named_parameters() pairs are not accepted either, pass model.parameters()"
)
GROUP_WITHOUT_PARAMS = "param group {index} has no 'params' key: every group dict needs one"
GROUP_PARAMS_SET = (
    "param group {index}: 'params' is a set, whose order differs between runs and ranks: "
    "pass a list"
)
NOT_DENSE = (
    "ZeroRedundancyOptimizer needs dense tensors on one device type, but param {index} is "
    "{what}: pass dense parameters (any floating dtypes may be mixed)"
)
NO_PARAMS = "every param group is empty: ZeroRedundancyOptimizer needs at least one parameter"
FUNCTIONAL_OPTIMIZER = (
    "{name} is a functional optimizer, used only with overlap_with_ddp=True: pass the "
    "torch.optim class instead (e.g. torch.optim.Adam)"
)


def params_as_list(params: Any) -> list[Any]:
    """Return ``params`` as a list, raising TypeError/ValueError as torch does."""
    if isinstance(params, torch.Tensor):
        raise TypeError(PARAMS_IS_TENSOR.format(typename=torch.typename(params)))
    try:
        items = list(params)
    except TypeError as exc:
        raise TypeError(PARAMS_NOT_ITERABLE.format(typename=torch.typename(params))) from exc
    if not items:
        raise ValueError(PARAMS_EMPTY)
    kinds = {type(item).__name__ for item in items}
    if not (
        all(isinstance(i, torch.Tensor) for i in items) or all(isinstance(i, dict) for i in items)
    ):
        raise TypeError(PARAMS_MIXED.format(kinds=sorted(kinds)))
    return items


def flatten(items: list[Any]) -> tuple[list[Any], list[Any]]:
    """Return (params for the core, every param in order); group dicts are copied."""
    if isinstance(items[0], torch.Tensor):
        return items, items
    groups, flat = [], []
    for index, group in enumerate(items):
        if "params" not in group:
            raise ValueError(GROUP_WITHOUT_PARAMS.format(index=index))
        members = group["params"]
        if isinstance(members, set):
            raise TypeError(GROUP_PARAMS_SET.format(index=index))
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        groups.append({**group, "params": members})
        flat.extend(members)
    return groups, flat


def check_dense(flat: list[Any]) -> None:
    """Raise ValueError (torch's type) for a non-tensor, sparse or other-device-type param."""
    if not flat:
        raise ValueError(NO_PARAMS)
    device_type = flat[0].device.type if isinstance(flat[0], torch.Tensor) else None
    for index, p in enumerate(flat):
        if not isinstance(p, torch.Tensor):
            raise ValueError(NOT_DENSE.format(index=index, what=f"a {type(p).__name__}"))
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(NOT_DENSE.format(index=index, what=f"sparse ({p.layout})"))
        if p.device.type != device_type:
            raise ValueError(
                NOT_DENSE.format(index=index, what=f"on {p.device.type}, param 0 on {device_type}")
            )


#: Raised for an ``optimizer_class`` string that names no ``torch.optim`` optimizer.
UNKNOWN_OPTIMIZER_NAME = (
    "optimizer_class {name!r} is not a torch.optim optimizer: expected one of {names}, or "
    "an optimizer class itself"
)


def optimizer_names() -> list[str]:
    """The ``torch.optim`` optimizer classes an ``optimizer_class`` string may name.

    Example:
        >>> {"Adam", "AdamW", "SGD"} <= set(optimizer_names())
        True
    """
    names = []
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        optimizer = isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
        if optimizer and value is not torch.optim.Optimizer:
            names.append(name)
    return sorted(names)


def resolve_optimizer_class(optimizer_class: Any) -> Any:
    """A ``torch.optim`` class name (``"AdamW"``, as config files write it) -> the class;
    anything else is returned as given.

    Raises:
        ValueError: a string that names no ``torch.optim`` optimizer
            (:data:`UNKNOWN_OPTIMIZER_NAME`, listing the accepted names).

    Example:
        >>> resolve_optimizer_class("AdamW") is torch.optim.AdamW
        True
    """
    if not isinstance(optimizer_class, str):
        return optimizer_class
    names = optimizer_names()
    if optimizer_class not in names:
        raise ValueError(UNKNOWN_OPTIMIZER_NAME.format(name=optimizer_class, names=names))
    return getattr(torch.optim, optimizer_class)


def check_optimizer_class(optimizer_class: Any) -> None:
    from torch.distributed.optim.utils import functional_optim_map

    if optimizer_class in functional_optim_map.values():
        raise ValueError(FUNCTIONAL_OPTIMIZER.format(name=optimizer_class.__name__))


def overlap_optimizer_class(optimizer_class: Any) -> Any:
    """Return the ``torch.optim`` class to step with: a functional class (what torch's
    overlap mode uses) is mapped back to its ``torch.optim`` class."""
    from torch.distributed.optim.utils import functional_optim_map

    for torch_class, functional in functional_optim_map.items():
        if optimizer_class is functional:
            return torch_class
    return optimizer_class
