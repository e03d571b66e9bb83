"""Which params every value computed during an optimizer's step comes from: a data-flow trace.

:class:`Tracer` follows, op by op, the *origins* of every tensor an optimizer's step makes or
writes: the set of params (by their index among the traced params) whose value, gradient or
state it was computed from. It sees every op through a ``TorchDispatchMode`` (the aten ops,
``_foreach_*`` and fused kernels included) and a ``TorchFunctionMode`` (host reads and the
Python numbers they give):

* an op's outputs, and the tensors it writes in place, take the union of its inputs' origins;
  a full overwrite (``copy_``, ``fill_``, ``zero_``, an ``out=`` argument) replaces them;
  ops that read only their inputs' shapes (``zeros_like``, ``new_empty``) add none;
* ops over lists (``_foreach_*``, ``_fused_adam_``) are followed per list index: output ``i``
  comes from the inputs at ``i`` and the op's other arguments only;
* a host read (``.item()``, ``float()``, ``int()``, ``bool()``, ``tolist()``, a comparison of
  those numbers) of a value from two params or more is recorded as coupling at once (a
  decision or a Python number that each rank would take from its own shard); a number read
  from one param's values carries that param on (:class:`TracedFloat`), into the ops it
  reaches and the param-group values it is stored in;
* a random draw adds its generator (``"rng:..."``): the default generator's stream is shared
  by every param, so which numbers a param gets depends on the params drawn before it;
* ``torch.autograd.grad`` and ``Tensor.backward`` called by the step are named, so that a
  Hessian-vector product reads as one.

Origins are kept per storage (views share their base's), at the granularity of a whole
storage: a param packed into one buffer with another reads as both (a refusal, never a miss).
The storages traced are kept alive until the trace ends, so a freed address is never taken
for another tensor. Nothing here is imported by the step: only :mod:`oss_plus.step.coupling`'s
probe runs it, once, at construction, on copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from oss_plus.step.probe.modes import DispatchMode, FunctionMode
from oss_plus.step.probe.numbers import EMPTY, Origin, Origins, params_in
from oss_plus.step.probe.ops import Arg, OpInfo, op_info, tensors

__all__ = ["Finding", "Tracer"]

#: Host reads in words.
_HOW = {
    "aten._local_scalar_dense": ".item(), float(), int() or bool()",
    "aten.equal": "torch.equal()",
    "aten.is_nonzero": "bool()",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """A value from several params that reached where each rank would see only its own.

    Attributes:
        kind: ``"host"`` (read on the host), ``"param"``, ``"state"``, ``"group"``,
            ``"global state"`` or ``"random"``.
        where: what was reached, in words.
        origins: the params it was computed from.
        via: the op (or call) where those params first met.
        step: the probe step (1-based) where it was seen.
    """

    kind: str
    where: str
    origins: tuple[int, ...]
    via: str
    step: int


class Tracer:
    """Follows the origins of every value an optimizer's step computes (see the module).

    Use as a context manager around the step; :meth:`label` the traced params (and their
    gradients) first. What was found is in :attr:`findings`.

    Origins are kept per element, as a bit mask in a shadow of every storage (bit ``i``:
    param ``i``; higher bits: random generators): elementwise ops, ``cat`` and ``stack`` and
    views keep them per element (a norm per param stacked, then unbound, stays per param);
    any other op gives every output element the union of all its inputs' elements.

    Example:
        >>> a, b = torch.ones(2), torch.ones(2)
        >>> tracer = Tracer()
        >>> tracer.label(a, {0}); tracer.label(b, {1})
        >>> with tracer:
        ...     _ = a.add_(b.sum())
        >>> sorted(tracer.origins(a))
        [0, 1]
    """

    def __init__(self, host: bool = True) -> None:
        self._host = host
        self._shadows: dict[int, torch.Tensor] = {}
        self._mixed: dict[int, str] = {}
        self._alive: list[Any] = []
        self._bits: dict[Origin, int] = {}
        self.pending: list[tuple[Origins, str | None]] = []
        self.findings: list[Finding] = []
        self.step = 0
        self.busy = False
        self._modes: list[Any] = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside is traced (the probe's own ops: gradients, labels, inspection)."""
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    def __enter__(self) -> Tracer:
        self._modes = [FunctionMode(self), DispatchMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    # -- origins <-> bit masks
    def _mask(self, origins: Iterable[Origin]) -> int:
        """Bits 0-31: the params; 32-62: random generators, as they are met."""
        mask = 0
        for o in origins:
            if o not in self._bits:
                if isinstance(o, int):
                    self._bits[o] = 1 << o
                else:
                    tokens = sum(1 for k in self._bits if not isinstance(k, int))
                    self._bits[o] = 1 << (32 + min(tokens, 30))
            mask |= self._bits[o]
        return mask

    def _decode(self, mask: int) -> Origins:
        return frozenset(o for o, bit in self._bits.items() if mask & bit)

    # -- shadows
    def _key(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The storage key of ``t`` and its shadow (one int64 per byte)."""
        try:
            storage = t.untyped_storage()
            key, size = storage._cdata, int(storage.nbytes())
            holder: Any = storage
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass, meta
            key, size, holder = id(t), 0, t
        shadow = self._shadows.get(key)
        if shadow is None or shadow.numel() < size:
            grown = torch.zeros(max(size, 1), dtype=torch.int64)
            if shadow is not None:
                grown[: shadow.numel()] = shadow
            else:
                self._alive.append(holder)
            self._shadows[key] = shadow = grown
        return key, shadow

    def labels(self, t: torch.Tensor) -> torch.Tensor:
        """The bit masks of ``t``'s elements (a tensor of ``t``'s shape)."""
        key, shadow = self._key(t)
        if shadow.numel() == 1 and t.numel() > 1:  # no storage: one mask for the tensor
            return shadow.expand(t.shape)
        e = t.element_size()
        try:
            return shadow.as_strided(t.shape, [s * e for s in t.stride()], t.storage_offset() * e)
        except RuntimeError:
            return shadow.amax().expand(t.shape)

    def _write(self, t: torch.Tensor, labels: torch.Tensor, via: str) -> None:
        key, shadow = self._key(t)
        e = t.element_size()
        try:
            view = shadow.as_strided(
                (*t.shape, e), [s * e for s in t.stride()] + [1], t.storage_offset() * e
            )
            view.copy_(labels.expand(t.shape).unsqueeze(-1).expand(view.shape))
        except RuntimeError:  # overlapping (expanded) memory: the whole storage
            shadow.bitwise_or_(_or_all(labels))
        if key not in self._mixed and len(params_in(self._decode(_or_all(labels)))) > 1:
            self._mixed[key] = via

    def origins(self, t: torch.Tensor) -> Origins:
        """The origins of ``t`` (of all its elements)."""
        return self._decode(_or_all(self.labels(t)))

    def via(self, t: torch.Tensor) -> str:
        """Where the params in ``t``'s origins first met."""
        return self._mixed.get(self._key(t)[0], "")

    def label(self, t: torch.Tensor, origins: Iterable[Origin], via: str = "") -> None:
        """Set ``t``'s origins (a traced param, its gradient, a loss)."""
        mask = self._mask(origins)
        self._write(t, torch.tensor(mask), via)
        if via:
            self._mixed[self._key(t)[0]] = via

    def add(self, t: torch.Tensor, origins: Origins, via: str) -> None:
        """Add ``origins`` to every element of ``t``."""
        self._write(t, self.labels(t) | self._mask(origins), via)

    def host_read(self, origins: Origins, how: str, via: str = "") -> None:
        """Record a host read of a value from ``origins`` (coupling from two params on)."""
        found = params_in(origins)
        if len(found) > 1 and self._host:
            how = _HOW.get(how, how)
            self.findings.append(Finding("host", how, tuple(found), via, self.step))

    def _context(self) -> tuple[Origins, str | None]:
        taint: set[Origin] = set()
        call = None
        for origins, name in self.pending:
            taint |= origins
            call = call or name
        return frozenset(taint), call

    # -- one op
    def record(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """Propagate origins through one op (the dispatch mode calls it after the op ran)."""
        info = op_info(func)
        taint, call = self._context()
        values = [
            args[a.position] if a.position < len(args) else kwargs.get(a.name) for a in info.args
        ]
        extra = self._mask(taint | self._seed(info, args, kwargs, out))
        via = self._first_via(values, call or info.name)
        lists = [v for a, v in zip(info.args, values) if a.is_list and isinstance(v, list) and v]
        if info.name in ("aten.cat", "aten.stack") and isinstance(out, torch.Tensor):
            self._joined(info, values, args, kwargs, out, extra, via)
        elif lists and (isinstance(out, (list, tuple)) or out is None):
            self._per_index(info, values, len(lists[0]), out, extra, via)
        else:
            self._whole(info, values, out, extra, via)

    def _seed(self, info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Origins:
        if not info.seeded:
            return EMPTY
        gen = kwargs.get("generator")
        if gen is None:
            gen = next((a for a in args if isinstance(a, torch.Generator)), None)
        if gen is not None:
            self._alive.append(gen)
            return frozenset({f"rng:generator {id(gen):#x}"})
        seen = [*tensors(out), *tensors(list(args))]
        device = seen[0].device.type if seen else "cpu"
        return frozenset({f"rng:the default {device} generator"})

    def _inputs(
        self, info: OpInfo, args: Sequence[Arg], values: Sequence[Any]
    ) -> list[torch.Tensor]:
        """The tensors an op reads values from (none for an op that reads shapes only, and
        not what it overwrites)."""
        if info.shape_only:
            return []
        return [
            t
            for a, v in zip(args, values)
            if not (a.written and info.overwrite)
            for t in tensors(v)
        ]

    def _result(
        self, info: OpInfo, inputs: Sequence[torch.Tensor], shape: torch.Size, extra: int
    ) -> torch.Tensor:
        """The masks of an output of ``shape``: per element for an elementwise op, else the
        union of every input element."""
        result = torch.full(tuple(shape), extra, dtype=torch.int64)
        if info.pointwise:
            try:
                for t in inputs:
                    result = result | self.labels(t)
                if tuple(result.shape) == tuple(shape):
                    return result
            except RuntimeError:  # not broadcastable as expected: the union
                pass
        mask = extra
        for t in inputs:
            mask |= _or_all(self.labels(t))
        return torch.full(tuple(shape), mask, dtype=torch.int64)

    def _whole(self, info: OpInfo, values: Sequence[Any], out: Any, extra: int, via: str) -> None:
        inputs = self._inputs(info, info.args, values)
        written = [t for a, v in zip(info.args, values) if a.written for t in tensors(v)]
        for t in written:
            self._write(t, self._result(info, inputs, t.shape, extra), via)
        keys = {self._key(t)[0] for v in values for t in tensors(v)}
        if isinstance(out, (torch.Tensor, list, tuple)):
            for t in tensors(out):
                if self._key(t)[0] not in keys:  # fresh (a view of an input keeps its own)
                    self._write(t, self._result(info, inputs, t.shape, extra), via)
        elif out is not None:  # a value for the host
            mask = extra
            for t in inputs:
                mask |= _or_all(self.labels(t))
            self.host_read(self._decode(mask), info.name, via)

    def _joined(
        self,
        info: OpInfo,
        values: Sequence[Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        out: torch.Tensor,
        extra: int,
        via: str,
    ) -> None:
        """``cat`` / ``stack``: each part of the output keeps its input's masks."""
        tensors = list(values[0])
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        join = torch.cat if info.name == "aten.cat" else torch.stack
        try:
            labels = join([self.labels(t) for t in tensors], dim) | extra
            if labels.shape != out.shape:
                raise RuntimeError("shape")
        except RuntimeError:
            labels = self._result(
                dataclasses.replace(info, pointwise=False), tensors, out.shape, extra
            )
        self._write(out, labels, via)

    def _per_index(
        self, info: OpInfo, values: Sequence[Any], n: int, out: Any, extra: int, via: str
    ) -> None:
        """``_foreach_*`` and fused steps: output ``i`` from the inputs at ``i`` and the
        op's other arguments."""
        indexed = [
            a.is_list and isinstance(v, list) and len(v) == n for a, v in zip(info.args, values)
        ]
        common = [(a, v) for a, v, i in zip(info.args, values, indexed) if not i]
        common_inputs = self._inputs(info, [a for a, _ in common], [v for _, v in common])
        outs = list(out) if isinstance(out, (list, tuple)) else []
        for i in range(n):
            at = [(a, v[i]) for a, v, x in zip(info.args, values, indexed) if x]
            inputs = common_inputs + self._inputs(info, [a for a, _ in at], [v for _, v in at])
            here = self._first_via([v for _, v in at], via)
            for a, v in at:
                if a.written and isinstance(v, torch.Tensor):
                    self._write(v, self._result(info, inputs, v.shape, extra), here)
            if len(outs) == n and not any(a.written for a, _ in at):
                for t in tensors(outs[i]):
                    self._write(t, self._result(info, inputs, t.shape, extra), here)

    def _first_via(self, values: Sequence[Any], via: str) -> str:
        for v in values:
            for t in tensors(v):
                found = self._mixed.get(self._key(t)[0])
                if found:
                    return found
        return via


def _or_all(labels: torch.Tensor) -> int:
    """The union of a tensor of bit masks."""
    if labels.numel() == 0:
        return 0
    return int(np.bitwise_or.reduce(labels.numpy(), axis=None))
