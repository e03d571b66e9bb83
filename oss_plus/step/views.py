"""Read-only views of an optimizer's shard plan, in the shapes its callers read.

:class:`PlanViews`, a mixin of :class:`oss_plus.OSS`, answers "which params, owned by whom,
travelling as what" from the plan alone: every param in flat-index order, each rank's param
groups (fairscale's ``partition_parameters``), each param's owner (what fairscale's
``ShardedDataParallel`` and oss_plus's own gradient sharding read), and the wire dtype of the
next step. It changes nothing and communicates nothing, and reads only the public members
of ``OSS`` (``param_groups``, ``plan``, ``local_shard``, ``world_size``, the wire flags).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from oss_plus.planning.plan import ShardPlan
from oss_plus.step.shard import LocalShard

__all__ = ["PlanViews"]


class PlanViews:
    """The plan's read-only views (module doc); a mixin of :class:`oss_plus.OSS`."""

    # provided by oss_plus.OSS
    param_groups: list[dict[str, Any]]
    if TYPE_CHECKING:  # properties of oss_plus.OSS

        @property
        def plan(self) -> ShardPlan: ...
        @property
        def local_shard(self) -> LocalShard: ...

    world_size: int
    broadcast_fp16: bool
    broadcast_dtype: torch.dtype | None

    def flat_params(self) -> list[torch.Tensor]:
        """Return every param of every group, in flat-index order (a new list)."""
        return [p for g in self.param_groups for p in g["params"]]

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Return, for every rank, its param groups (fairscale's ``partition_parameters``).

        Element ``r`` lists one dict per global group with the hyperparameters of that group
        and the params rank ``r`` owns (under the flat rule: holds a piece of; this rank's
        own entry lists its piece tensors in place of split params).
        """
        return [self.local_shard.local_groups(rank) for rank in range(self.world_size)]

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Map every param to the group-local rank that owns it (a split param: the owner of
        its first piece; ``plan.pieces`` has all of them)."""
        return dict(zip(self.flat_params(), self.plan.owners))

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype parameters travel as at the next step (None: their own)."""
        return torch.float16 if self.broadcast_fp16 else self.broadcast_dtype
