"""What the fairscale and torch adapters share on top of the core :class:`oss_plus.OSS`.

* :meth:`CompatOSS.refresh_trainable` keeps the inner optimizer (and its identity, which
  integrations hold on to) when the partition does not change, as both anchors do; the core
  rebuilds it and moves state only when owners change.
* :meth:`CompatOSS._rank_state_dicts` derives, from the core's consolidated state (by flat
  index), the per-rank *local* state dicts the anchors keep after consolidation
  (fairscale's ``_all_states``, torch's ``_all_state_dicts``), without a second exchange.
* :meth:`CompatOSS.state_dict` returns every state tensor on CPU, as both anchors do.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from oss_plus.optimizer import OSS

__all__ = ["CompatOSS"]

logger = logging.getLogger(__name__)

#: Keys of a param group that are not hyperparameters.
_NOT_HYPER = ("params", "param_names")


class CompatOSS(OSS):
    """Base of the drop-in adapters: the core optimizer plus the anchors' shared internals."""

    def refresh_trainable(self) -> None:
        """Rebuild the sync layout for the current trainability; repartition if it changes.

        When the partition rule gives every param the same owner as before (always the case
        for torch's rule, which weighs frozen params fully), only the buckets are rebuilt and
        the inner optimizer is kept. Otherwise the core repartitions and moves every affected
        optimizer state to its new owner.

        .. warning:: Collective: call on every rank of ``group``.
        """
        if self._plan() == self._owners:
            self._rebuild_sync()
            return
        super().refresh_trainable()

    def _rank_state_dicts(self) -> list[dict[str, Any]]:
        """Return every rank's local state dict, as its inner optimizer would produce it.

        Local indices follow each rank's inner param groups; tensors are the consolidated ones
        (shared, not copied). Empty when nothing was consolidated on this rank.
        """
        if self._consolidated is None:
            return []
        consolidated = self._consolidated
        names = [n for g in self.param_groups for n in g.get("param_names", ())]
        result = []
        for rank in range(self.world_size):
            state: dict[int, Any] = {}
            groups: list[dict[str, Any]] = []
            position = 0
            for g, indices in enumerate(self._local_indices(rank)):
                global_group = self.param_groups[g]
                packed = {
                    k: copy.deepcopy(v) for k, v in global_group.items() if k not in _NOT_HYPER
                }
                if "param_names" in global_group:
                    packed["param_names"] = [names[i] for i in indices]
                packed["params"] = list(range(position, position + len(indices)))
                for offset, index in enumerate(indices):
                    if index in consolidated:
                        state[position + offset] = consolidated[index]
                position += len(indices)
                groups.append(packed)
            result.append({"state": state, "param_groups": groups})
        return result

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """Return the full state in the plain ``torch.optim`` format, every tensor on CPU.

        Args:
            all_ranks: consolidate on every rank first (collective).

        Raises:
            RuntimeError: nothing was consolidated on this rank.
        """
        state_dict = super().state_dict(all_ranks)
        state_dict["state"] = {
            index: {
                key: value.cpu() if isinstance(value, torch.Tensor) else value
                for key, value in param_state.items()
            }
            for index, param_state in state_dict["state"].items()
        }
        return state_dict

    @staticmethod
    def _sync_param_groups(source: list[dict[Any, Any]], destination: list[dict[Any, Any]]) -> None:
        """Copy every key but ``params`` from ``source`` groups to ``destination`` groups.

        Both anchors expose this helper (schedulers and integrations call it).
        """
        for source_group, destination_group in zip(source, destination):
            for key, value in source_group.items():
                if key != "params":
                    destination_group[key] = value
