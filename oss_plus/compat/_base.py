"""What the fairscale and torch adapters share on top of the core :class:`oss_plus.OSS`.

* :meth:`CompatOSS._rank_state_dicts` derives, from the core's consolidated state (by flat
  index), the per-rank *local* state dicts the anchors keep after consolidation
  (fairscale's ``_all_states``, torch's ``_all_state_dicts``), without a second exchange.
"""

from __future__ import annotations

import logging
from typing import Any

from oss_plus.optimizer import OSS
from oss_plus.state.index import copy_hyper, local_state_dict

__all__ = ["CompatOSS"]

logger = logging.getLogger(__name__)


class CompatOSS(OSS):
    """Base of the drop-in adapters: the core optimizer plus the anchors' shared internals."""

    def _rank_state_dicts(self) -> list[dict[str, Any]]:
        """Return every rank's local state dict, as its inner optimizer would produce it.

        Local indices follow each rank's inner param groups; tensors are the consolidated ones
        (shared, not copied). Empty when nothing was consolidated on this rank.
        """
        consolidated = self.consolidated_state
        if consolidated is None:
            return []
        return [
            local_state_dict(
                self.param_groups, self.plan.local_indices(rank), consolidated, copy_tensors=False
            )
            for rank in range(self.world_size)
        ]

    @staticmethod
    def _sync_param_groups(source: list[dict[Any, Any]], destination: list[dict[Any, Any]]) -> None:
        """Copy every key but ``params`` from ``source`` groups to ``destination`` groups.

        Both anchors expose this helper (schedulers and integrations call it).
        """
        copy_hyper(source, destination, exclude=("params",))
