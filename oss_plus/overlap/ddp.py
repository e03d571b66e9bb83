"""The DDP side of the overlapped step: the reduction hook, the reduced gradients, checks.

No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` inspects the
hook's annotations and accepts only the real ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]`` objects, not strings.
"""

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from oss_plus.optimizer import OSS
from oss_plus.planning.partition import Rule
from oss_plus.runtime import dist as _dist

__all__ = ["CommHook", "check_pairing", "ddp_reduce_hook", "grad_views", "reduce_bucket"]

logger = logging.getLogger(__name__)

#: A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``.
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
#: Raised when DDP and the optimizer do not shard over the same ranks.
GROUP_MISMATCH = (
    "DDP reduces over global ranks {ddp} but the optimizer shards over {opt}: pass the same "
    "process group to DDP(process_group=...) and to the optimizer"
)
#: Raised when a param DDP reduces is not in the optimizer, or the reverse.
PARAM_NOT_IN_DDP = (
    "param {index} of the optimizer requires grad but DDP does not reduce it (not in "
    "ddp.module, or ignored): it would never be updated; give the optimizer ddp.parameters()"
)
PARAM_NOT_IN_OPTIMIZER = (
    "DDP reduces a param ({shape}) the optimizer does not hold: give the optimizer every "
    "trainable param of ddp.module (e.g. ddp.parameters())"
)


def ddp_reduce_hook(
    process_group: Any, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in gradient averaging as a comm hook (the default of the overlap helper).

    Multiplies the bucket by ``1 / world_size`` (a Python float, as DDP's reducer does) and
    all-reduces the sum. torch's ``allreduce_hook`` divides instead, which rounds
    differently when the world size is not a power of two (1 ulp at world size 3), so DDP +
    ``allreduce_hook`` is not bit-identical to DDP without a hook; with this hook the
    gradients equal DDP's own bit for bit (tested in fp32, world sizes 2 to 4, with and
    without ``gradient_as_bucket_view``). Under the overlap
    (:class:`~oss_plus.overlap.DDPOverlap`), ``backward()`` returns only once gloo's worker
    let go of this all-reduce (see :func:`reduce_bucket`).

    Args:
        process_group: the group to average over (None: WORLD, as torch's hooks).
        bucket: the gradient bucket.

    Returns:
        A future holding the averaged bucket.

    .. warning:: Collective: call on every rank of ``process_group``.
    """
    return reduce_bucket(process_group, bucket)[0]


def reduce_bucket(
    process_group: Any, bucket: dist.GradBucket
) -> tuple[torch.futures.Future[torch.Tensor], list[tuple[torch.Tensor, int]]]:
    """:func:`ddp_reduce_hook`, also returning what its collective holds.

    The all-reduce is given its own tensor object over the bucket's memory (``detach()``, a
    view), so that only this collective and the caller hold it: once the work is done, its
    use count is back to the one returned, which :func:`oss_plus.runtime.dist.await_release` waits
    for. (The bucket's own tensor is held by DDP's reducer and its ``GradBucket`` copies,
    whose number changes during ``backward()``, so its count says nothing.) Why wait: a work
    issued inside ``backward()`` holds torch's thread-local state, which references a Python
    object (the context autograd stashes for the backward), and gloo's worker destroys the
    work after the future completed, taking the GIL: during interpreter exit that aborts
    the process (docs/reliability.md, "Process exit").

    Returns:
        The future of the averaged bucket, and ``(tensor, use count before)`` of the tensor
        the all-reduce was given (the caller keeps it until it waited).

    .. warning:: Collective: call on every rank of ``process_group``.
    """
    group = dist.group.WORLD if process_group is None else process_group
    buffer = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
    tensor = buffer.detach()
    held = list(zip([tensor], _dist.use_counts([tensor])))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(functools.partial(_reduced, buffer)), held


def _reduced(buffer: torch.Tensor, fut: torch.futures.Future[Any]) -> torch.Tensor:
    """The hook's result: the bucket's own tensor (DDP makes its views of it)."""
    fut.value()  # raises the collective's error, if any
    return buffer


def grad_views(bucket: dist.GradBucket, value: Any) -> list[torch.Tensor]:
    """Return the reduced gradients of ``bucket``'s params, as views of the hook's result.

    DDP copies the result into ``param.grad`` only after backward; until then the averaged
    values live in the future's value (usually ``bucket.buffer()`` itself).
    """
    result = value[0] if isinstance(value, (list, tuple)) else value
    grads = bucket.gradients()
    buffer = bucket.buffer()
    if result.data_ptr() == buffer.data_ptr() and result.numel() == buffer.numel():
        return grads
    base = buffer.storage_offset()
    return [
        result.as_strided(g.size(), g.stride(), result.storage_offset() + g.storage_offset() - base)
        for g in grads
    ]


def _ddp_params(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    params = getattr(ddp, "_module_parameters", None) or list(ddp.module.parameters())
    return [p for p in params if p.requires_grad]


#: Raised for an optimizer with the flat partition rule.
FLAT_RULE = (
    "the overlap with DDP steps whole params per DDP bucket and does not take "
    "partition_rule='flat' (which cuts params across ranks): step the flat OSS after "
    "backward() as usual, or use partition_rule='fairscale' / 'torch' for the overlap"
)


def check_pairing(ddp: DistributedDataParallel, optimizer: OSS) -> None:
    """Raise unless ``ddp`` and ``optimizer`` cover the same ranks and trainable params.

    Raises:
        TypeError: ``optimizer`` is not an :class:`oss_plus.OSS` (or adapter).
        ValueError: different ranks, or a trainable param only one of them holds.
    """
    if not isinstance(optimizer, OSS):
        raise TypeError(f"the optimizer must be an oss_plus.OSS, got {type(optimizer).__name__}")
    if optimizer.policy.rule is Rule.FLAT:
        raise ValueError(FLAT_RULE)
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    opt_ranks = dist.get_process_group_ranks(optimizer.group)
    if ddp_ranks != opt_ranks:
        raise ValueError(GROUP_MISMATCH.format(ddp=ddp_ranks, opt=opt_ranks))
    reduced = {id(p) for p in _ddp_params(ddp)}
    held = {id(p) for p in optimizer.flat_params()}
    for index, p in enumerate(optimizer.flat_params()):
        if p.requires_grad and id(p) not in reduced:
            raise ValueError(PARAM_NOT_IN_DDP.format(index=index))
    for p in _ddp_params(ddp):
        if id(p) not in held:
            raise ValueError(PARAM_NOT_IN_OPTIMIZER.format(shape=tuple(p.shape)))
