"""What :class:`~oss_plus.data_parallel.ShardedDataParallel` watches between forwards, and
how it builds a reducer for the current params and partition.

:class:`Watch` holds what the last plan was made from (the optimizers' ``plan`` objects,
the params registered in the submodules, their ``requires_grad`` and data addresses) and
compares it with what is there now. The optimizers' plans are compared at every forward
(a few identity checks); the per-param comparisons are C-level passes (no Python per
param) and run only when ``auto_refresh_trainable`` asks for automatic detection.

:func:`build_reducer` plans the buckets (:func:`~oss_plus.data_parallel.plan.plan_buckets`)
from the optimizers' public contract: ``param_to_rank``, ``plan`` and ``flat_params()``
(the flat rule's layout), and routes a cut param's piece to ``OSS.set_piece_grad`` (which a
grad scaler unscales through ``OSS``'s side of torch's scaling contract,
:mod:`oss_plus.amp.scaler`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from oss_plus.data_parallel import _validate
from oss_plus.data_parallel.plan import BucketCap, GradSpec, ReducePlan, plan_buckets
from oss_plus.data_parallel.reducer import GradReducer
from oss_plus.optimizer import OSS

__all__ = ["Settings", "Watch", "build_reducer", "plan_for"]

#: Read from every param in a C-level pass: trainability, and the address of its data,
#: which changes whenever ``module.to(...)`` / ``.double()`` replace it.
_TRAINABLE = operator.attrgetter("requires_grad")
_ADDRESS = torch.Tensor.data_ptr
_PARAMETERS = operator.attrgetter("_parameters")
_VALUES = operator.methodcaller("values")


class Watch:
    """What the current plan was made from (see module doc)."""

    def __init__(self, module: nn.Module, optimizers: Sequence[OSS]) -> None:
        self.module, self.optimizers = module, list(optimizers)
        self.submodules = list(module.modules())
        self.registered = self._registered()
        self.params = list(module.parameters())
        self.trainable = list(map(_TRAINABLE, self.params))
        self.addresses = list(map(_ADDRESS, self.params))
        self.plans = [o.plan for o in optimizers]

    def _registered(self) -> list[Any]:
        """Every entry of the submodules' parameter dicts, shared params repeated."""
        return list(chain.from_iterable(map(_VALUES, map(_PARAMETERS, self.submodules))))

    def plans_changed(self) -> bool:
        """Whether an optimizer repartitioned since (O(number of optimizers))."""
        return not all(map(operator.is_, [o.plan for o in self.optimizers], self.plans))

    def params_changed(self) -> bool:
        """Whether params were replaced, re-allocated or changed trainability (C-level)."""
        registered = self._registered()
        return not (
            len(registered) == len(self.registered)
            and all(map(operator.is_, registered, self.registered))
            and list(map(_TRAINABLE, self.params)) == self.trainable
            and list(map(_ADDRESS, self.params)) == self.addresses
        )

    def trainability_changed(self) -> bool:
        """Whether ``requires_grad`` changed since (call after :meth:`params_changed`)."""
        return list(map(_TRAINABLE, self.params)) != self.trainable

    def addresses_changed(self) -> bool:
        """Whether params were re-allocated (dtype or device) since."""
        return list(map(_ADDRESS, self.params)) != self.addresses


class Settings:
    """The wrapper's reduction settings a reducer is built with."""

    def __init__(
        self,
        group: Any,
        bucket_numel: BucketCap,
        wire: torch.dtype | None,
        collective: str,
        find_unused: bool,
        replicate: Any = None,
    ) -> None:
        self.group, self.bucket_numel, self.wire = group, bucket_numel, wire
        self.collective, self.find_unused = collective, find_unused
        self.replicate = replicate


def plan_for(
    module: nn.Module, optimizers: Sequence[OSS], bucket_numel: BucketCap, order: list[int] | None
) -> tuple[list[torch.Tensor], ReducePlan]:
    """The trainable params (the reducer's indices) and their buckets."""
    named = list(module.named_parameters())
    owners = _validate.owners_of(optimizers, named)
    trainable: list[torch.Tensor] = [p for _, p in named if p.requires_grad]
    specs = [
        GradSpec(p.numel(), owners[p], (p.dtype, p.device), p.element_size()) for p in trainable
    ]
    flat = _validate.flat_keys(optimizers, trainable)
    return trainable, plan_buckets(specs, bucket_numel, order, flat)


def _piece_receiver(
    optimizers: Sequence[OSS], trainable: list[torch.Tensor]
) -> Callable[[int, torch.Tensor | None], None]:
    """Route the reduced piece of a cut param (flat rule) to its optimizer's
    ``set_piece_grad``; ``trainable`` is indexed like the reducer's params."""
    where: dict[int, tuple[OSS, int]] = {}
    for optimizer in optimizers:
        params = optimizer.flat_params()
        for index in optimizer.plan.split:
            where[id(params[index])] = (optimizer, index)
    route = {k: where[id(p)] for k, p in enumerate(trainable) if id(p) in where}

    def give(k: int, grad: torch.Tensor | None) -> None:
        optimizer, index = route[k]
        optimizer.set_piece_grad(index, grad)

    return give


def build_reducer(
    module: nn.Module, optimizers: Sequence[OSS], settings: Settings, order: list[int] | None
) -> GradReducer:
    """A reducer over the current trainable params and partition (buckets in ``order``;
    without one, the next backward's order is recorded)."""
    trainable, plan = plan_for(module, optimizers, settings.bucket_numel, order)
    return GradReducer(
        trainable,
        plan,
        settings.group,
        settings.wire,
        settings.collective,
        order is None,
        settings.find_unused,
        _piece_receiver(optimizers, trainable),
        settings.replicate,
    )
