"""How the parameter sync of ``OSS.step`` runs: :class:`StepDriver`, owned by the optimizer.

Every step launches the sync (:meth:`oss_plus.wire.sync.BucketSync.launch`) with this rank's
status code, then either waits for all of it, or, once a model is attached
(:meth:`oss_plus.OSS.attach`), leaves it in flight for the model's forward pre-hooks
(:class:`oss_plus.wire.inflight.ForwardWaits`: each module waits for its own buckets) and for the
library's next entry point. What the peers reported is checked there
(:class:`oss_plus.wire.status.StepStatus`), with no read and no collective while every rank
reports :data:`~oss_plus.wire.status.OK`. A rank whose plan changed runs the sync unstepped with
:data:`~oss_plus.wire.status.REPLAN` (:meth:`StepDriver.replan`).

Every rank counts its steps (:attr:`StepDriver.steps`, public as
:attr:`oss_plus.OSS.step_count`); the arrival checks of the collective entry points compare
the counts. On gloo every wait for the sync is bounded by the arrival timeout
(:func:`oss_plus.runtime.arrival.arrival_timeout`): a step whose peers are elsewhere (they
skipped it, or called another entry point) raises :data:`STEP_NOT_MATCHED`, naming where every
rank is (:mod:`oss_plus.runtime.positions`), instead of waiting for the group's timeout.

An installed sync that is not a :class:`~oss_plus.wire.sync.BucketSync` (the contract of
:meth:`oss_plus.OSS.install_sync`) is run the older way: ``sync(wire, error)``, which
checks at once and raises on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from oss_plus.runtime import positions
from oss_plus.runtime.arrival import arrival_timeout
from oss_plus.wire.inflight import ForwardWaits, InFlight
from oss_plus.wire.status import FAILED, OK, REPLAN, StepStatus
from oss_plus.wire.sync import BucketSync

__all__ = ["STEP_NOT_MATCHED", "StepDriver"]

logger = logging.getLogger(__name__)

#: Raised by ``step()`` (or the wait for its sync) when the peers' part of the sync did not
#: come: ``error`` is what the backend raised, ``where`` every rank's position.
STEP_NOT_MATCHED = (
    "step() is collective, but the parameter sync of this rank's step {step} did not "
    "complete ({error}; the arrival timeout is {seconds:g}s). Where the ranks are: {where}. "
    "Every rank must call step() alike: a rank skipped a step() or called it twice, or made "
    "another collective call meanwhile. This rank's own params took its step; the process "
    "group is left with a collective half done: restart from a checkpoint (a rank that is "
    "only slow needs a longer OSS_PLUS_ARRIVAL_TIMEOUT)"
)


class StepDriver:
    """The sync of every step: launched, waited (at once or by the attached forwards),
    its status checked at the next check.

    Args:
        group: the optimizer's process group.
        world_size: its size.
    """

    def __init__(self, group: Any, world_size: int) -> None:
        self.world_size = world_size
        self.group = group
        #: the steps this rank made (every rank alike): syncs run, a step that failed
        #: included, a step a ``GradScaler`` skipped on every rank not
        self.steps = 0
        self.status = StepStatus(group)
        self.inflight: InFlight | None = None
        self.waits: list[ForwardWaits] = []

    def wait(self) -> None:
        """Wait for the sync still in flight, if any (not collective)."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            try:
                inflight.wait()
            except RuntimeError as exc:
                self._not_matched(exc)

    def _not_matched(self, exc: RuntimeError) -> NoReturn:
        """Raise :data:`STEP_NOT_MATCHED` for a wait that timed out (or a backend error)."""
        if self.world_size == 1:
            raise exc
        self.inflight = None
        timeout = arrival_timeout()
        mine = f"in step() (its step {self.steps})"
        text = STEP_NOT_MATCHED.format(
            step=self.steps,
            error=positions.first_line(exc),
            seconds=timeout.total_seconds(),
            where=positions.where(self.group, mine, timeout),
        )
        raise RuntimeError(text) from exc

    def settle(self) -> None:
        """Wait, then raise on every rank what the last step reported (see
        :meth:`oss_plus.OSS.settle`).

        .. warning:: Collective when a step failed: call on every rank of the group.
        """
        self.wait()
        self.status.check()

    def send(self, sync: Any, wire: torch.dtype | None, error: Exception | None) -> None:
        """Start the sync with this rank's status; wait for it unless a model is attached
        (then wait only for the params no attached module owns).

        .. warning:: Collective: call on every rank of the group.
        """
        if self.world_size == 1 or not isinstance(sync, BucketSync):
            self.steps += 1
            sync.sync(wire, error)  # raises on every rank (at world size 1: here)
            return
        code = OK if error is None else FAILED
        if error is not None:
            logger.warning("the local step raised %r; every rank raises at the next check", error)
        self.steps += 1
        sync.timeout = arrival_timeout()
        self.inflight = inflight = sync.launch(wire, code)
        self.status.sent(code, error, sync.status)
        if not self.waits:
            self.wait()
            return
        inflight.holding = sync.holding()  # the attached forwards wait bucket by bucket
        try:
            for waits in self.waits:
                inflight.wait_for_params(waits.uncovered)
        except RuntimeError as exc:
            self._not_matched(exc)

    def replan(self, sync: BucketSync, wire: torch.dtype | None) -> bool:
        """This rank's plan changed: run the sync unstepped with :data:`REPLAN` and read every
        rank's code now (the one host read, on this rare path only). Returns whether every
        rank sent it (then they repartition together); else every rank raises
        :data:`~oss_plus.wire.status.TRAINABILITY_DIFFERS` at the next check.

        .. warning:: Collective: call on every rank of the group, as its step's sync.
        """
        sync.restore(wire)  # what is sent unstepped: the params' values, as a step would
        sync.timeout = arrival_timeout()
        self.steps += 1
        try:
            sync.launch(wire, REPLAN).wait()
        except RuntimeError as exc:
            self._not_matched(exc)
        if all(code == REPLAN for code in sync.status.codes(REPLAN)):
            self.steps -= 1  # every rank repartitions, then steps: counted by its send()
            return True
        logger.warning("requires_grad changed here, not on every rank: this rank skips the step")
        self.status.sent(REPLAN, None, sync.status)
        return False

    def attach(self, model: torch.nn.Module, params: Sequence[torch.Tensor]) -> ForwardWaits:
        """Overlap every later sync with ``model``'s next forward (see
        :meth:`oss_plus.OSS.attach`). Not collective."""
        waits = ForwardWaits(model, params, self._wait_params, self._detach)
        self.waits.append(waits)
        return waits

    def _detach(self, waits: ForwardWaits) -> None:
        self.waits = [w for w in self.waits if w is not waits]
        self.wait()

    def _wait_params(self, params: Sequence[torch.Tensor]) -> None:
        """A forward pre-hook of :meth:`attach`: wait for the transfers of ``params``."""
        inflight = self.inflight
        if inflight is not None:
            try:
                inflight.wait_for_params(params)
            except RuntimeError as exc:
                self._not_matched(exc)
