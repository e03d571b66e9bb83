"""Pieces of parameters under the flat partition rule: the tensors a rank's inner optimizer
steps, and the translation of optimizer state between whole params and pieces.

Under :attr:`~oss_plus.planning.partition.Rule.FLAT` a param may be cut into pieces owned by several
ranks (:class:`~oss_plus.planning.plan.ShardPlan`, ``split``). A rank's inner optimizer then holds,
for such a param, a 1-D tensor over the elements ``[start, end)`` of the flattened param
(:class:`PieceTargets`); it shares the param's memory, so stepping the piece updates the
param. Its gradient is the same slice of the param's gradient, set before every local step
(one view per split param this rank holds: at most two per flat buffer).

Optimizer state of a piece holds, for every tensor shaped like the param, the same slice
(1-D); every other value (the ``step`` count) is the param's. Only optimizers whose update is
elementwise may be cut like this (:data:`ELEMENTWISE`): their state is then exactly the
slices of the unsharded optimizer's state, which :mod:`oss_plus.state.pieces` translates
(PURE, no collectives).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from oss_plus.planning.plan import ShardPlan
from oss_plus.state.index import ParamState

# stitch_state: also for the 0.2 path oss_plus.pieces.stitch_state (oss_plus._moved), until 0.4
from oss_plus.state.pieces import slice_state, stitch_state  # noqa: F401

__all__ = [
    "PieceGrads",
    "ELEMENTWISE",
    "ELEMENTWISE_NAMES",
    "NOT_ELEMENTWISE",
    "PieceTargets",
    "elementwise",
    "is_elementwise",
    "unwrap_partial",
]

#: ``torch.optim`` classes whose update of every element reads only that element's gradient,
#: state and hyperparameters: the flat rule is exact for them.
ELEMENTWISE: set[type] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
}

#: Classes of optional packages whose update is elementwise, by ``module.qualname`` (looked
#: up by name: the core imports none of them). Each passes the flat rule's exactness tests
#: (pieces stepped on several ranks, bit for bit the unsharded optimizer's params):
#: schedulefree's three, whose ``eval()``/``train()`` are elementwise too (every param moves
#: towards its own ``z``; ``tests/test_modes.py``), and pytorch_optimizer's and
#: lion-pytorch's (``tests/test_zoo_flat.py``). heavyball's ``AdamW`` passes eagerly but
#: compiles its step per shape by default, so it is not declared.
ELEMENTWISE_NAMES: frozenset[str] = frozenset(
    {
        "schedulefree.adamw_schedulefree.AdamWScheduleFree",
        "schedulefree.sgd_schedulefree.SGDScheduleFree",
        "schedulefree.radam_schedulefree.RAdamScheduleFree",
        "pytorch_optimizer.optimizer.schedulefree.ScheduleFreeAdamW",
        "pytorch_optimizer.optimizer.lion.Lion",
        "pytorch_optimizer.optimizer.adopt.ADOPT",
        "pytorch_optimizer.optimizer.ademamix.AdEMAMix",
        "pytorch_optimizer.optimizer.adan.Adan",
        "lion_pytorch.lion_pytorch.Lion",
    }
)

#: Raised (on every rank) for the flat rule with an optimizer not known to be elementwise.
NOT_ELEMENTWISE = (
    "partition_rule='flat' cuts parameters into pieces stepped on different ranks, which is "
    "exact only for optimizers whose update is elementwise ({known}); {name} is not known to "
    "be (per-tensor norms as in LARS/LAMB, factored moments as in Adafactor, Shampoo's "
    "preconditioners or the quantization blocks of 8-bit/4-bit/fp8 Adam would change). If "
    "every update of {name} reads only the same element of "
    "the gradient and state, declare it with oss_plus.elementwise({name}); else use "
    "partition_rule='fairscale' or 'torch', which keep every parameter whole"
)


def elementwise(cls: type) -> type:
    """Declare an optimizer class elementwise, so the flat rule accepts it (a decorator).

    Example:
        >>> @elementwise
        ... class MySGD(torch.optim.SGD): ...
        >>> is_elementwise(MySGD)
        True
    """
    if not isinstance(cls, type):
        raise TypeError(f"elementwise() takes an optimizer class, got {cls!r}")
    ELEMENTWISE.add(cls)
    return cls


def unwrap_partial(optim: Any) -> Any:
    """``optim`` without the ``functools.partial`` layers around it (a class, usually)."""
    while isinstance(optim, functools.partial):
        optim = optim.func
    return optim


def is_elementwise(optim: Any) -> bool:
    """Whether ``optim`` (a class, or a ``functools.partial`` of one) is in :data:`ELEMENTWISE`
    or named in :data:`ELEMENTWISE_NAMES`.

    Subclasses are not: a subclass may change the update (LAMB derives from Adam in places).
    """
    cls = unwrap_partial(optim)
    return cls in ELEMENTWISE or _qualified(cls) in ELEMENTWISE_NAMES


def _qualified(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}"


def not_elementwise_message(optim: Any) -> str:
    """The :data:`NOT_ELEMENTWISE` message for ``optim``."""
    names = [c.__name__ for c in ELEMENTWISE] + [n.rsplit(".", 1)[1] for n in ELEMENTWISE_NAMES]
    known = ", ".join(sorted(names))
    name = getattr(unwrap_partial(optim), "__name__", repr(optim))
    return NOT_ELEMENTWISE.format(known=known, name=name)


class PieceTargets:
    """The 1-D tensors one rank's inner optimizer steps for the params it holds a piece of.

    Only params split by the plan get a piece tensor; a param the rank owns whole is stepped
    as itself. The tensors keep their identity (the inner optimizer's state is keyed by them)
    while their memory follows the layout's (:meth:`point`, after every layout change): a
    slice of the param, or where the sync keeps the piece of a param that spans its buckets
    (:mod:`oss_plus.wire.split_params`).

    Args:
        params: every param, by flat index.
        plan: the shard plan.
        rank: this rank.
    """

    def __init__(self, params: Sequence[torch.Tensor], plan: ShardPlan, rank: int) -> None:
        self.rank = rank
        #: every param, by flat index
        self.params = list(params)
        self.pieces: dict[int, tuple[int, int]] = {}
        for i in sorted(plan.split):
            piece = plan.piece(rank, i)
            if piece is not None:
                self.pieces[i] = (piece.start, piece.end)
        self.tensors: dict[int, torch.Tensor] = {i: self._slice(i).detach() for i in self.pieces}
        #: Gradients of pieces handed over directly (ZeRO-2), used instead of a slice of the
        #: param's ``.grad`` until the step consumes them.
        self.given: dict[int, torch.Tensor] = {}

    def give(self, index: int, grad: torch.Tensor | None) -> None:
        """Set (None: drop) the gradient of this rank's piece of param ``index``.

        Raises:
            ValueError: this rank holds no piece of ``index``, or ``grad`` is not a 1-D
                tensor of the piece's length, dtype and device.
        """
        if index not in self.pieces:
            raise ValueError(
                f"param {index} is not split with a piece on rank {self.rank}: set its .grad"
            )
        if grad is None:
            self.given.pop(index, None)
            return
        piece = self.tensors[index]
        if grad.shape != piece.shape or grad.dtype != piece.dtype or grad.device != piece.device:
            raise ValueError(
                f"the gradient of the piece {self.pieces[index]} of param {index} must be a "
                f"{piece.dtype} tensor of shape {tuple(piece.shape)} on {piece.device}, got "
                f"{grad.dtype} {tuple(grad.shape)} on {grad.device}"
            )
        self.given[index] = grad

    def _slice(self, index: int) -> torch.Tensor:
        start, end = self.pieces[index]
        return self.params[index].data.view(-1)[start:end]

    def targets(self) -> list[torch.Tensor]:
        """Every param by flat index, a split one replaced by this rank's piece tensor."""
        return [self.tensors.get(i, p) for i, p in enumerate(self.params)]

    @torch.no_grad()
    def point(
        self, locate: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None = None
    ) -> None:
        """Make every piece tensor a view of its piece's memory (after a layout): what
        ``locate(param, start, end)`` returns (the sync's
        :meth:`~oss_plus.wire.sync.BucketSync.piece_view`), else a slice of its param."""
        for i, tensor in self.tensors.items():
            found = None if locate is None else locate(self.params[i], *self.pieces[i])
            tensor.data = self._slice(i) if found is None else found

    def zero_given(self, set_to_none: bool) -> None:
        """Drop (or zero) the gradients handed over with :meth:`give` (``zero_grad``)."""
        if set_to_none:
            self.given.clear()
        else:
            for grad in self.given.values():
                grad.zero_()

    def set_grads(self) -> None:
        """Give every piece tensor its gradient: one handed over (:meth:`give`), else the
        matching slice of its param's gradient (a view).

        A non-contiguous gradient is made contiguous first, so that the slice is a view and
        in-place changes (clipping) reach the param's gradient.
        """
        given = self.given
        for i, tensor in self.tensors.items():
            if i in given:
                tensor.grad = given[i]
                continue
            param = self.params[i]
            grad = param.grad
            if grad is None:
                tensor.grad = None
                continue
            if not grad.is_contiguous():
                param.grad = grad = grad.contiguous()
            start, end = self.pieces[i]
            tensor.grad = grad.view(-1)[start:end]

    def clear_grads(self) -> None:
        """Drop the gradient views (after the step: the params' ``zero_grad`` frees them)."""
        for tensor in self.tensors.values():
            tensor.grad = None

    def slice_states(self, states: Mapping[int, ParamState]) -> dict[int, ParamState]:
        """Return ``states`` (whole params' states by flat index) with every param this rank
        holds a piece of cut to its piece (:func:`~oss_plus.state.pieces.slice_state`)."""
        return {
            i: (slice_state(s, self.params[i].shape, *self.pieces[i]) if i in self.pieces else s)
            for i, s in states.items()
        }


class PieceGrads:
    """The gradients of the pieces of split params, a mixin of :class:`oss_plus.OSS` built
    on its extension contract (``local_shard``): what ZeRO-2 hands to the flat rule."""

    local_shard: Any  # provided by oss_plus.OSS

    def set_piece_grad(self, index: int, grad: torch.Tensor | None) -> None:
        """Hand over the gradient of this rank's piece of the split param ``index``.

        For a param the plan splits (``plan.split``, the flat rule), the next
        :meth:`clip_grad_norm` and :meth:`step` use ``grad`` (1-D, the piece's length, the
        param's dtype and device) instead of the slice of the param's ``.grad``, so a rank
        need not hold the whole gradient of a param it holds only a piece of (ZeRO-2:
        :class:`oss_plus.ShardedDataParallel`). ``ShardedGradScaler`` unscales and checks it
        like a ``.grad``, and so does :meth:`step` under a plain ``GradScaler.step``
        (:mod:`oss_plus.amp.scaler`). :meth:`step` and :meth:`zero_grad` drop it; None drops it now.

        Raises:
            ValueError: this rank holds no piece of ``index``, or ``grad`` does not fit it.
        """
        self.local_shard.targets.give(index, grad)

    def piece_grads(self) -> dict[int, torch.Tensor]:
        """The gradients handed over with :meth:`set_piece_grad`, by flat index (a new dict)."""
        return dict(self.local_shard.targets.given)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; also drops (or zeroes) the gradients handed
        over with :meth:`set_piece_grad`."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self.local_shard.targets.zero_given(set_to_none)
