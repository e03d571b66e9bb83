"""Strict devices for the GPU suite's tasks, so that their CPU twin catches device mix-ups.

On a GPU, a task that builds its reference without a device (``make_model()`` instead of
``make_model().to(device)``) compares CUDA results with CPU ones; on the CPU, where the task's
device IS the default one, the same mistake goes unseen. Inside :class:`StrictDevices`,
the memory of every tensor whose device was never chosen explicitly is marked: made by a
constructor without ``device=`` (``torch.randn``, ``nn.Linear``'s init), or computed out of
place from a marked tensor without an explicit move (``.to(device)``, ``.cuda()``, ``.cpu()``).
Marks belong to storages, so they follow aliases (``nn.Parameter(t)``, ``p.data = t``,
views); an in-place op keeps its destination's mark. A comparison (``torch.equal``,
``allclose``, ``isclose``) of a marked tensor, or of tensors on two devices, raises
AssertionError: on the CPU exactly as on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_leaves

#: Raised for a comparison of a tensor whose device was never chosen.
IMPLICIT = (
    "{name} compares a tensor whose device was never chosen (made without device=, and not "
    "moved with .to(device)): on a GPU it would be on the CPU. Create it on the task's device"
)
#: Raised for a comparison of tensors on two devices.
MIXED = "{name} compares tensors on {devices}: create both on the task's device"

_CONSTRUCTORS = _device_constructors()
_COMPARISONS = {
    torch.equal,
    torch.allclose,
    torch.isclose,
    torch.Tensor.equal,
    torch.Tensor.allclose,
    torch.Tensor.isclose,
}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _explicit_move(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a ``to``/``cuda``/``cpu`` call names its target device."""
    if func is not torch.Tensor.to:
        return True
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device, int, torch.Tensor)) for a in args[1:])


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor without storage
        return None


class StrictDevices(TorchFunctionMode):
    """Within the block, comparisons must involve tensors on one device, each created or
    moved there explicitly (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # storage address -> a weak reference to it (which also keeps the address unique)
        self.implicit: dict[int, StorageWeakRef] = {}

    def marked(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        ref = None if storage is None else self.implicit.get(storage._cdata)
        return ref is not None and not ref.expired()

    def _check(self, name: str, args: tuple) -> None:
        tensors = _tensors(args)
        if any(self.marked(t) for t in tensors):
            raise AssertionError(IMPLICIT.format(name=name))
        devices = sorted({str(t.device) for t in tensors})
        if len(devices) > 1:
            raise AssertionError(MIXED.format(name=name, devices=devices))

    def _mark(self, tree: Any, implicit: bool) -> None:
        for t in _tensors(tree):
            storage = _storage(t)
            if storage is None:
                continue
            if implicit:
                self.implicit[storage._cdata] = StorageWeakRef(storage)
            else:
                self.implicit.pop(storage._cdata, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in _COMPARISONS:
            self._check(name, args)
        out = func(*args, **kwargs)
        if func in _CONSTRUCTORS:
            self._mark(out, kwargs.get("device") is None)
        elif func in _MOVES and _explicit_move(func, args, kwargs):
            self._mark(out, False)
        elif not name.endswith("_") and not name.startswith("__i"):  # out of place
            self._mark(out, any(self.marked(t) for t in _tensors((args, kwargs))))
        return out
