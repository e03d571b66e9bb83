"""``ShardedDataParallel``: ZeRO-2, each gradient is reduced to the rank that owns it.

A drop-in for ``fairscale.nn.data_parallel.ShardedDataParallel`` (fairscale 0.4.13): same
constructor, ``forward``, ``no_sync()``, ``refresh_trainable()``, ``reduce()``,
``sync_buffers()``, ``zero_grad()`` and attribute fall-through, plus the attributes
trainers read from DDP (``is_multi_device_module``, ``device_type``, ``device``,
``device_ids``, ``output_device``, ``require_backward_grad_sync``). Ownership comes from the
sharded optimizer's public ``param_to_rank``; the reduction is planned by
:mod:`oss_plus.data_parallel.plan` and run by :mod:`oss_plus.data_parallel.reducer` over
:mod:`oss_plus.data_parallel.buckets`; what changed before a forward, and the re-plan it
calls for, is :mod:`oss_plus.data_parallel.replan`'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from oss_plus.data_parallel import _validate
from oss_plus.data_parallel.buckets import pick_collective
from oss_plus.data_parallel.compress import resolve_wire
from oss_plus.data_parallel.plan import BucketCap
from oss_plus.data_parallel.reducer import GradReducer
from oss_plus.data_parallel.replan import Change, ReduceReplanner, graph_grads
from oss_plus.data_parallel.wiring import Settings
from oss_plus.optimizer import OSS
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label

__all__ = ["ShardedDataParallel"]

logger = logging.getLogger(__name__)

#: Logged (once per change) when trainability changes are detected at forward.
TRAINABLE_CHANGED = (
    "ShardedDataParallel detected that the trainable params changed (freezing or "
    "unfreezing): repartitioning the optimizer(s) and re-planning the reduction"
)


class ShardedDataParallel(nn.Module):
    """Wrap a module so each gradient is averaged onto the rank that owns its param (ZeRO-2).

    After backward, a rank holds ``.grad`` only for the params its sharded optimizer owns
    (the others are ``None``), equal to the average over the ranks as DDP computes it.
    Gradients travel in buckets, reduced to their owner while backward goes on. A bucket
    holds the gradients of one owner and closes as DDP's do: once it holds at least
    ``bucket_cap_mb`` MiB; or, when ``reduce_buffer_size`` is given, as fairscale's: before
    it would exceed that many elements. The gradients a rank owns are views of persistent buckets
    (like DDP's ``gradient_as_bucket_view``); the others pass through transient buckets and
    are dropped (fairscale keeps every bucketed gradient on every rank).

    Args:
        module: the model, on its final device, identical on every rank.
        sharded_optimizer: an :class:`oss_plus.OSS` (or ``oss_plus.compat.fairscale.OSS``),
            or a list of them over disjoint params; they define who owns each gradient.
        process_group: the ranks to reduce over (default: WORLD, or the optimizer's group
            under hybrid sharding); must be the optimizers'.
        broadcast_buffers: broadcast the module's buffers from rank 0 at every forward, as
            DDP does.
        sync_models_at_startup: broadcast params and buffers from rank 0 now.
        reduce_buffer_size: fairscale's bucket size, in elements: a bucket closes before it
            would exceed it; 0 sends each gradient alone. Default (None): sized by
            ``bucket_cap_mb``.
        auto_refresh_trainable: detect ``requires_grad``, dtype and param changes at every
            forward (C-level passes over the params) and repartition / re-plan. False:
            forward makes no pass over the params; call :meth:`refresh_trainable` after
            such a change (as with fairscale).
        reduce_fp16: send gradients as fp16 (DDP's ``fp16_compress_hook``), in any bucket
            setting (fairscale turns it off when buckets are used).
        warn_on_trainable_params_changed: log a warning when trainability changes.
        reduce_dtype: keyword-only wire dtype, ``torch.float16`` or ``torch.bfloat16``
            (``reduce_fp16=True`` wins).
        collective: keyword-only, how buckets travel: ``"reduce"`` (each to its owner),
            ``"reduce_scatter"`` (buckets of different owners in one
            ``reduce_scatter_tensor``) or ``"auto"``: reduce on gloo (measured faster),
            reduce_scatter on NCCL.
        find_unused_parameters: keyword-only, as DDP's (default True): a param that got no
            gradient on any rank keeps ``grad=None`` on its owner, as DDP leaves it. That
            costs one "had a gradient" flag per param, sent after its bucket's gradients
            by the bucket's own collective (no collective of its own). With False no flags
            travel and such a param gets a zero gradient on its owner, as
            fairscale's ``ShardedDataParallel`` gives it (a param used on some ranks only is
            averaged correctly either way; DDP with False raises in that case). Choose False
            when every param gets a gradient at every backward, or when zeros are fine.
        replicate_group: keyword-only, hybrid sharding (default: the optimizers'
            ``replicate_group``): each bucket is reduced to its owner within
            ``process_group``, then the owner all-reduces it across this group, during
            backward (``docs/hybrid.md``). Must be the optimizers'.
        bucket_cap_mb: keyword-only, DDP's bucket size in MiB (default 25): a bucket closes
            once it holds at least that much, as DDP's. Not with ``reduce_buffer_size``.

    Raises:
        TypeError: ``sharded_optimizer`` is not an OSS or a list of OSS.
        ValueError: an optimizer over other ranks, trainable params in no optimizer, a param
            in two optimizers, params on several device types, a bad ``reduce_dtype``,
            ``collective`` or bucket size, both ``reduce_buffer_size`` and ``bucket_cap_mb``.
        All are raised on every rank of ``process_group``.

    Example:
        >>> opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)  # doctest: +SKIP
        >>> model = ShardedDataParallel(model, opt)  # doctest: +SKIP
        >>> model(x).sum().backward(); opt.step(); model.zero_grad()  # doctest: +SKIP

    .. warning:: Collective: construct, run forward/backward, ``refresh_trainable``,
       ``reduce`` and ``sync_buffers`` on every rank of ``process_group``.
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: OSS | list[OSS],
        process_group: Any = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int | None = None,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        *,
        reduce_dtype: torch.dtype | None = None,
        collective: str = "auto",
        find_unused_parameters: bool = True,
        replicate_group: Any = None,
        bucket_cap_mb: float | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        process_group, replicate_group = _validate.default_groups(
            sharded_optimizer, process_group, replicate_group
        )
        self.process_group = _dist.resolve_group(process_group)
        #: Hybrid sharding: the ranks owning the same gradients in the other shard groups.
        self.replicate_group = replicate_group
        self._optimizers: list[OSS] = []
        error: Exception | None = None
        cap = BucketCap(0)
        try:
            self._optimizers = _validate.check_optimizers(sharded_optimizer, self.process_group)
            _validate.check_replicas(self._optimizers, replicate_group)
            self._wire = resolve_wire(reduce_fp16, reduce_dtype)
            self.collective = pick_collective(collective, self.process_group)
            cap = _validate.bucket_cap(reduce_buffer_size, bucket_cap_mb)
            types = sorted({p.device.type for p in module.parameters()})
            if len(types) > 1:
                raise ValueError(_validate.MIXED_DEVICE_TYPES.format(types=types))
            _validate.owners_of(self._optimizers, list(module.named_parameters()))
            for optimizer in self._optimizers:  # each rank holds only its own gradients
                optimizer.handle_loss_scaling()
        except (TypeError, ValueError) as exc:
            error = exc
        graph = graph_grads(module)
        # A gradient that requires grad was there at construction on some rank: the first
        # forward raises on every rank (as fairscale's, which checks at its first forward).
        refuse = any(_dist.agree(error, self.process_group, value=int(graph)))
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        #: fairscale's bucket size in elements (None: ``bucket_cap_mb`` sizes the buckets)
        self.reduce_buffer_size = reduce_buffer_size
        #: DDP's bucket size in MiB (None when ``reduce_buffer_size`` sizes the buckets)
        self.bucket_cap_mb = cap.limit / 2**20 if cap.in_bytes else None
        self.auto_refresh_trainable = auto_refresh_trainable
        #: As DDP's: whether params without a gradient anywhere keep ``grad=None`` (read at
        #: every re-plan).
        self.find_unused_parameters = find_unused_parameters
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        devices = {p.device for p in module.parameters()}
        #: As DDP and fairscale: whether the module's params span several devices.
        self.is_multi_device_module = len(devices) > 1
        #: As DDP and fairscale: the device type of the module's params ("cpu", "cuda", ...).
        self.device_type = next(iter(devices)).type if devices else "cpu"
        #: As DDP: the device of the first param.
        self.device = next(iter(module.parameters())).device if devices else torch.device("cpu")
        #: As DDP constructed without ``device_ids``: inputs are not moved or scattered.
        self.device_ids: list[int] | None = None
        self.output_device: int | None = None
        self._accumulate = False
        settings = Settings(
            self.process_group,
            cap,
            self._wire,
            self.collective,
            find_unused_parameters,
            replicate_group,
        )
        if sync_models_at_startup:
            self._broadcast(list(module.state_dict().values()))
        self._reduction = ReduceReplanner(
            module, self._optimizers, settings, refuse, self._bucket_cap(), find_unused_parameters
        )

    # ----------------------------------------------------------------- DDP-like surface
    @property
    def sharded_optimizers(self) -> list[OSS]:
        """The sharded optimizers that decide who owns each gradient."""
        return list(self._optimizers)

    @property
    def _reducer(self) -> GradReducer:
        """The reducer of the current plan (the ``ReduceReplanner``'s)."""
        return self._reduction.reducer

    # Not traced by torch.compile (nor _pre_forward): dynamo compiles the module only, as under
    # DDP, and breaks no graph in oss_plus (docs/compile.md). The first call imports
    # torch._dynamo, as the first step of any torch.optim optimizer does anyway.
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; the backward that follows reduces each gradient to its owner.

        Checks first: a new partition of the optimizer (re-plan; a few identity checks) and,
        with ``auto_refresh_trainable``, in C-level passes over the params, params moved to
        another device (error), trainability changes (repartition) or new dtypes
        (re-plan). Buffers are broadcast from rank 0 like DDP.

        Raises:
            ValueError: a param changed device after wrapping.
            RuntimeError: a param's ``.grad`` requires grad (double backward, refused as
                fairscale refuses it; :data:`~oss_plus.data_parallel.reducer.GRAD_REQUIRES_GRAD`).

        .. warning:: Collective: call on every rank of ``process_group``.
        """
        scope = self._pre_forward()
        try:
            return self.module(*inputs, **kwargs)
        finally:
            scope.__exit__(None, None, None)

    @torch._disable_dynamo  # recursive: none of this is traced (see forward)
    def _pre_forward(self) -> AbstractContextManager[Any]:
        """The wrapper's work before the module runs; returns the forward's profiler range,
        entered (the caller exits it after the module ran)."""
        scope = label("oss_plus::sdp::forward")
        scope.__enter__()
        try:
            self._refresh_if_changed()
            reduction = self._reduction
            if reduction.refuse_at_forward or self._reducer.graph_grad:
                reduction.refuse_graph_grads()
            if self._reducer.observed is not None:
                agreed = reduction.observed_order(self._reducer.observed, self._bucket_cap())
                if agreed is not None:
                    self._replan(order=agreed)
            if self.broadcast_buffers and reduction.buffers:
                self._broadcast(reduction.buffers)
            if self.training and torch.is_grad_enabled():
                self._reducer.start_pass(reduce=not self._accumulate)
            else:
                self._reducer.quiet()
        except BaseException:
            scope.__exit__(None, None, None)
            raise
        return scope

    @property
    def require_backward_grad_sync(self) -> bool:
        """As DDP: False inside :meth:`no_sync` (the next forward's backward does not reduce).

        Setting it is what DDP's ``no_sync()`` does, and what some trainers do directly.
        """
        return not self._accumulate

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._accumulate = not value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside this context do not reduce: gradients accumulate on every rank.

        Like DDP, the decision is taken at forward; the first backward after a forward
        outside the context reduces the accumulated gradients.
        """
        previous = self._accumulate
        self._accumulate = True
        try:
            yield
        finally:
            self._accumulate = previous

    def reduce(self) -> None:
        """Reduce the gradients now (after a backward inside :meth:`no_sync`).

        Not needed in normal training: backward reduces by itself.

        Raises:
            RuntimeError: nothing is waiting to be reduced.

        .. warning:: Collective: call on every rank of ``process_group``.
        """
        self._reducer.reduce_now()

    def refresh_trainable(self) -> None:
        """Repartition the optimizers for the current ``requires_grad`` and re-plan.

        Called automatically at forward when ``auto_refresh_trainable`` (the default).

        Raises:
            ValueError: a newly trainable param is in no optimizer.

        .. warning:: Collective: call on every rank of ``process_group`` (a call on some ranks
            only raises there within the arrival timeout, :mod:`oss_plus.runtime.arrival`).
        """
        with (
            _arrival.entry(self.process_group, "refresh_trainable()"),
            label("oss_plus::sdp::refresh_trainable"),
        ):
            if self._reducer.pending and not self._accumulate:
                logger.warning(
                    "refresh_trainable() with gradients waiting to be reduced; for gradient "
                    "accumulation use no_sync()"
                )
            for optimizer in self._optimizers:
                optimizer.refresh_trainable()
            self._replan()

    @torch.no_grad()
    def sync_buffers(self, blocking: bool = False) -> None:
        """Broadcast the module's buffers from rank 0 of ``process_group``.

        Args:
            blocking: wait for the broadcasts (always done on non-NCCL backends).

        .. warning:: Collective: call on every rank of ``process_group``.
        """
        self._broadcast(list(self.module.buffers()), blocking)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero (or drop, with ``set_to_none``) the gradients of the module's params."""
        for param in self.module.parameters():
            grad = param.grad
            if set_to_none:
                param.grad = None
            elif grad is not None:
                if grad.grad_fn is not None:
                    grad.detach_()  # never a bucket view: those have no grad_fn
                else:
                    grad.requires_grad_(False)
                grad.zero_()

    def __getattr__(self, name: str) -> Any:
        """Fall through to the wrapped module for attributes the wrapper does not have."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    # ----------------------------------------------------------------- internals
    def _broadcast(self, tensors: list[torch.Tensor], blocking: bool = True) -> None:
        """From rank 0 of the shard group, then (hybrid) from the first shard group."""
        for group in (self.process_group, self.replicate_group):
            if group is None:
                continue
            src = _dist.global_rank(group, 0)
            with torch.no_grad():
                works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
            second = group is self.process_group and self.replicate_group is not None
            if blocking or second or dist.get_backend(group) != dist.Backend.NCCL:
                for work in works:
                    work.wait()

    def _refresh_if_changed(self) -> None:
        """Re-plan when the partition changed; with ``auto_refresh_trainable``, also when the
        params changed; repartition first when their trainability changed
        (:meth:`~oss_plus.data_parallel.replan.ReduceReplanner.change`)."""
        change = self._reduction.change(self.auto_refresh_trainable)
        if change is Change.TRAINABILITY:
            if self.warn_on_trainable_params_changed:
                logger.warning(TRAINABLE_CHANGED)
            self.refresh_trainable()
        elif change is Change.REPLAN:
            self._replan()

    def _replan(self, order: list[int] | None = None) -> None:
        """Rebuild the reduce plan and hooks (buckets in ``order``; without one, the next
        backward's order is recorded and followed) with the current bucket settings."""
        self._reduction.replan(self._bucket_cap(), self.find_unused_parameters, order)

    def _bucket_cap(self) -> BucketCap:
        """The buckets' cap from :attr:`reduce_buffer_size` or :attr:`bucket_cap_mb`."""
        return _validate.bucket_cap(self.reduce_buffer_size, self.bucket_cap_mb)
