"""The transfers of one parameter sync while they run: wait for some buckets, or for all.

:meth:`oss_plus.wire.sync.BucketSync.launch` starts every collective of a sync and returns an
:class:`InFlight`. The blocking step waits for all of it at once; the step whose sync is
overlapped with the next forward (:meth:`oss_plus.OSS.attach`, Megatron-Core's
``overlap_param_gather``) waits for a bucket when a module that owns params in it is first
called (:class:`ForwardWaits`: forward pre-hooks), and for the rest at the library's next
entry point. After the last wait, the peers' status codes are staged for the next check
(:meth:`oss_plus.wire.status.PeerSlots.stage`) and the call returns only once gloo released the
tensors it was given (:func:`oss_plus.runtime.dist.await_release`).
"""

from __future__ import annotations

import bisect
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from oss_plus.runtime import dist as _dist
from oss_plus.runtime.trace import label
from oss_plus.wire.status import PeerSlots

__all__ = ["ForwardWaits", "InFlight", "Pending", "holding_buckets"]


class Pending:
    """A started transfer: :meth:`wait` waits for it (and widens a compressed copy), once.

    ``held`` lists the tensors the collective was given, with their use counts from before
    it, for :func:`oss_plus.runtime.dist.await_release`.
    """

    __slots__ = ("finish", "held")

    def __init__(self, finish: Callable[[], None], held: list[tuple[torch.Tensor, int]]):
        self.finish: Callable[[], None] | None = finish
        self.held = held

    def wait(self) -> None:
        """Wait (the first call only), then drop the work handle so that gloo's worker can
        let go of the tensors."""
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()

    __call__ = wait


class InFlight:
    """Every transfer one sync started.

    Args:
        pending: the transfers, in the order they were started.
        covers: for ``id(bucket)``, the transfer that brings that bucket.
        status: where the peers' codes arrive (staged after the last wait), or None.
        group: the group of the collectives.
        holding: for ``id(param)``, the buckets holding its memory.
        release: whether to wait for the worker to let go of the tensors (default:
            :func:`oss_plus.runtime.dist.releases_late` of ``group``; a sync passes what it looked
            up once per layout).
    """

    def __init__(
        self,
        pending: list[Pending],
        covers: dict[int, Pending],
        status: PeerSlots | None,
        group: Any,
        holding: dict[int, list[Any]] | None = None,
        release: bool | None = None,
    ) -> None:
        self.pending = pending
        self.release = _dist.releases_late(group) if release is None else release
        self.covers = covers
        self.status = status
        self.group = group
        self.holding = holding or {}
        self.done = not pending

    def wait_for_params(self, params: Iterable[torch.Tensor]) -> None:
        """Wait for the transfers that bring ``params`` (not collective)."""
        if not self.done:
            for p in params:
                self.wait_for(self.holding.get(id(p), ()))

    def wait_for(self, buckets: Iterable[Any]) -> None:
        """Wait for the transfers that bring ``buckets`` (not collective)."""
        for bucket in buckets:
            transfer = self.covers.get(id(bucket))
            if transfer is not None:
                transfer.wait()

    def wait(self) -> None:
        """Wait for every transfer, stage the peers' codes, and return once gloo let go of
        every tensor (not collective: the transfers were started on every rank)."""
        if self.done:
            return
        with label("oss_plus::sync.wait"):
            for transfer in self.pending:
                transfer.wait()
        held = [h for p in self.pending for h in p.held]
        self.pending, self.covers, self.done = [], {}, True
        if self.release:
            _dist.await_counts([t for t, _ in held], [c for _, c in held])
        if self.status is not None:
            self.status.stage()


def holding_buckets(
    buckets: Sequence[Any], pieces: dict[int, list[Any]], params: Iterable[torch.Tensor]
) -> dict[int, list[Any]]:
    """For ``id(param)`` of every param, the buckets holding its memory: those it is a view
    of (several for a view across flat ranges), and those of ``pieces`` (``id(param)`` ->
    the buckets holding its pieces, a param with storage of its own,
    :mod:`oss_plus.wire.split_params`): what :meth:`InFlight.wait_for_params` waits for."""
    spans = sorted(
        (b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.nbytes, i)
        for i, b in enumerate(buckets)
    )
    starts = [start for start, _, _ in spans]
    holding = {k: list(v) for k, v in pieces.items()}
    for p in params:
        low, high = p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()
        at = max(0, bisect.bisect_right(starts, low) - 1)
        found = holding.setdefault(id(p), [])
        while at < len(spans) and spans[at][0] < high:  # a view across ranges too
            if spans[at][1] > low:
                found.append(buckets[spans[at][2]])
            at += 1
    return holding


def _pre_hook(
    wait: weakref.WeakMethod[Callable[[Sequence[torch.Tensor]], None]],
    params: tuple[torch.Tensor, ...],
    module: torch.nn.Module,
    args: Any,
) -> None:
    method = wait()  # the hooks never keep the optimizer alive
    if method is not None:
        method(params)


class ForwardWaits:
    """Forward pre-hooks on every module of ``model`` that directly owns params of an
    optimizer: each waits, when its module is called, for the transfers bringing those
    params (a no-op once they arrived, and when nothing is in flight).

    Args:
        model: the model whose forward uses the optimizer's params.
        params: the optimizer's params.
        wait: waits for the transfers of the given params (the optimizer's).
        detached: called once the hooks are removed.

    Attributes:
        uncovered: the params of the optimizer that no module of ``model`` owns (the step
            waits for their transfers before it returns).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: Sequence[torch.Tensor],
        wait: Callable[[Sequence[torch.Tensor]], None],
        detached: Callable[[ForwardWaits], None],
    ) -> None:
        mine = {id(p) for p in params}
        weak = weakref.WeakMethod(wait)
        seen: set[int] = set()
        self.handles = []
        for module in model.modules():
            own = tuple(p for p in module.parameters(recurse=False) if id(p) in mine)
            if own:
                hook = functools.partial(_pre_hook, weak, own)
                self.handles.append(module.register_forward_pre_hook(hook))
                seen.update(id(p) for p in own)
        self.uncovered = [p for p in params if id(p) not in seen]
        self._detached = weakref.WeakMethod(detached)

    @property
    def active(self) -> bool:
        """Whether the hooks are still registered."""
        return bool(self.handles)

    def remove(self) -> None:
        """Remove the hooks: the optimizer's steps wait for their sync again."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        detached = self._detached()
        if detached is not None:
            detached(self)
