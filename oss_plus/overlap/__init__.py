"""Overlap the sharded optimizer step with DDP's gradient all-reduce, inside a comm hook.

With plain DDP + :class:`oss_plus.OSS`, ``backward()`` all-reduces the gradients bucket by
bucket, then ``step()`` updates this rank's shard and broadcasts every shard. Here the step
moves into DDP's communication hook: as soon as a gradient bucket is reduced, every rank
steps the params of that bucket it owns and broadcasts them, while DDP is still reducing
later buckets. The training loop calls no ``step()``::

    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=pg, lr=1e-3)
    ddp = DDP(model, process_group=pg)
    overlap_with_ddp(ddp, opt)
    for batch in batches:
        opt.zero_grad()
        ddp(batch).sum().backward()          # reduces, steps and broadcasts

The optimizer keeps its own partition (no state moves, checkpoints are unchanged) and
updates from the first iteration: there is no warm-up. With the default reduction hook
(:func:`ddp_reduce_hook`) results are bit-identical in fp32 to plain DDP + the unsharded
optimizer (see ``docs/overlap.md``).

Two schedules, as in torch:

* default (``interleaved=False``, torch's ``hook_with_zero_step``): when the last bucket's
  gradients are computed, wait for each bucket's all-reduce in order, step it, start its
  broadcasts; then wait for the broadcasts.
* ``interleaved=True`` (torch's ``hook_with_zero_step_interleaved``): each bucket is stepped
  as soon as its all-reduce completes (a ``then`` callback), while backward goes on.

Why torch's interleaved hook hangs on gloo, and what is done instead: a gloo future's
``then`` callbacks run on the process group's worker threads in completion order, which
differs between ranks, and torch issues the bucket's broadcasts from that callback on the
same group the autograd thread issues all-reduces on. Each rank then issues its collectives
in a different order (measured: rank 0 ``broadcast(10050), broadcast(20200)``, rank 1 the
reverse), and gloo pairs collectives by issue order: a hang. Here callbacks only *compute*
(the local step); every collective is issued from the hook, i.e. the autograd thread, in
bucket order: the broadcasts of bucket ``i`` are issued when bucket ``i + 1`` arrives (on
NCCL, whose futures complete at launch, right away), after its step finished. The order is
then the same on every rank on any backend, and no extra process group is needed.

Failures: an exception raised by the inner optimizer (or its hooks) while one rank steps
a bucket is kept; the bucket's pieces still travel, carrying a status slot, so no rank is
left mid-collective, and after the last bucket every rank raises from ``backward()``
naming the failing rank (see ``docs/overlap.md``).

Modules: :mod:`~oss_plus.overlap.engine` (the hook), :mod:`~oss_plus.overlap.ddp` (the
reduction hook and pairing checks), :mod:`~oss_plus.overlap.layout` (the piece layout),
:mod:`~oss_plus.overlap.plan` (pure planning, torch's bucket assignment).
"""

from oss_plus.overlap.ddp import (
    GROUP_MISMATCH,
    PARAM_NOT_IN_DDP,
    PARAM_NOT_IN_OPTIMIZER,
    CommHook,
    check_pairing,
    ddp_reduce_hook,
)
from oss_plus.overlap.engine import (
    PARAMS_CHANGED,
    DDPOverlap,
    Gate,
    Planner,
    overlap_hook,
    overlap_with_ddp,
)

__all__ = [
    "GROUP_MISMATCH",
    "PARAMS_CHANGED",
    "PARAM_NOT_IN_DDP",
    "PARAM_NOT_IN_OPTIMIZER",
    "CommHook",
    "DDPOverlap",
    "Gate",
    "Planner",
    "check_pairing",
    "ddp_reduce_hook",
    "overlap_hook",
    "overlap_with_ddp",
]
