"""Gradient sharding (ZeRO-2): :class:`ShardedDataParallel` and its reduce plan.

* :mod:`~oss_plus.data_parallel.plan` (pure): which gradients travel together, to whom.
* :mod:`~oss_plus.data_parallel.buckets`: bucket storage and the collectives that send them.
* :mod:`~oss_plus.data_parallel.reducer`: runs the plan during backward.
* :mod:`~oss_plus.data_parallel.compress`: pre-division and fp16/bf16 wire compression.
* :mod:`~oss_plus.data_parallel.replan`: what changed before a forward, and the re-plan.
* :mod:`~oss_plus.data_parallel.sharded_ddp`: the ``nn.Module`` wrapper.
"""

from oss_plus.data_parallel.sharded_ddp import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
