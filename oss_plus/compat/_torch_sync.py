"""The two parameter-sync layouts of ``torch.distributed.optim.ZeroRedundancyOptimizer``.

Both reuse :class:`oss_plus.sync.BucketSync` (one async broadcast per bucket from its owner,
optional wire compression); only the layout differs, and the layout decides the memory
addresses of the params, hence how CPU kernels round: mirroring torch's layout is what makes
results bit-identical to torch ZeRO's.

* :class:`OrderedBucketSync` (``parameters_as_bucket_view=True``): per owner (and device,
  dtype) one flat buffer holding the owner's trainable params back to back *in partition
  order* (largest first within each group, groups one after the other); ``param.data``
  becomes a view into it. torch also broadcasts a 1-element dummy for an owner without
  trainable params; nothing is sent for it here.
* :class:`ParamBroadcast` (``parameters_as_bucket_view=False``): every param of every owner,
  frozen ones included, is broadcast by itself from its own storage, which is never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from oss_plus.sync import Bucket, BucketSync

__all__ = ["OrderedBucketSync", "ParamBroadcast"]


class OrderedBucketSync(BucketSync):
    """torch's bucket views: each owner's trainable params back to back, in the given order.

    Args:
        params_by_owner: for every group-local rank, its params in partition order (frozen
            ones are skipped).
        group: the process group.
    """

    def __init__(self, params_by_owner: Sequence[Sequence[torch.Tensor]], group: Any) -> None:
        super().__init__([[] for _ in params_by_owner], group, aligned=False)
        for owner, params in enumerate(params_by_owner):
            by_key: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
            for p in params:
                if p.requires_grad:
                    by_key.setdefault((str(p.device), p.dtype), []).append(p)
            for members in by_key.values():
                self.buckets.append(self._make_bucket(owner, members, aligned=False))
        self._ptrs = self._current_ptrs()


class ParamBroadcast(BucketSync):
    """torch's default: one broadcast per param (frozen ones too), params keep their storage.

    Each "bucket" is a single param whose buffer is ``param.data`` itself, so nothing is
    copied and :meth:`release` has nothing to give back.

    Args:
        params_by_owner: for every group-local rank, its params in partition order.
        group: the process group.
    """

    def __init__(self, params_by_owner: Sequence[Sequence[torch.Tensor]], group: Any) -> None:
        super().__init__([[] for _ in params_by_owner], group, aligned=False)
        for owner, params in enumerate(params_by_owner):
            self.buckets.extend(Bucket(owner, p.data, [p]) for p in params)
        self._ptrs = self._current_ptrs()

    def release(self) -> None:
        """Drop the layout; params already own their storage."""
        self.buckets = []
        self._ptrs = []
