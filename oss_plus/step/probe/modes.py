"""The two modes a :class:`oss_plus.step.probe.trace.Tracer` runs under: every aten op is seen
after it ran (``TorchDispatchMode``: the origins flow through it), every Python-level call
before (``TorchFunctionMode``: host reads, the numbers they give, the traced numbers a call
takes, and which calls differentiate)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from oss_plus.step.probe.numbers import taint_of, wrap_nested
from oss_plus.step.probe.ops import tensors

__all__ = ["DispatchMode", "FunctionMode"]

#: Python-level reads of a tensor's values into host numbers.
_HOST_READS = frozenset({"item", "__float__", "__int__", "__index__", "__bool__", "tolist"})


class DispatchMode(TorchDispatchMode):
    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracer = self.tracer
        if not tracer.busy:
            with tracer.paused():  # the shadows' own ops are not traced
                tracer.record(func, args, kwargs, out)
        return out


class FunctionMode(TorchFunctionMode):
    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        name = getattr(func, "__name__", "")
        if tracer.busy or name in ("__get__", "__set__"):  # attributes compute nothing
            return func(*args, **kwargs)
        taint = taint_of(args) | taint_of(kwargs.values())
        call = "torch.autograd.grad" if func is torch.autograd.grad else None
        call = call or ("Tensor.backward" if name == "backward" else None)
        tracer.pending.append((taint, call))
        try:
            out = func(*args, **kwargs)
        finally:
            tracer.pending.pop()
        with tracer.paused():
            if name in _HOST_READS and args and isinstance(args[0], torch.Tensor):
                origins = tracer.origins(args[0]) | taint
                tracer.host_read(origins, f"Tensor.{name}()", tracer.via(args[0]))
                return wrap_nested(out, origins, tracer) if name != "__bool__" else out
            if taint:
                for t in tensors(out):
                    tracer.add(t, taint, "a Python number read from a param")
        return out
