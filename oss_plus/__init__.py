"""oss_plus: sharded optimizer state and gradients (ZeRO-1 and ZeRO-2) on torch.distributed.

The public API is ``__all__`` below plus the subpackages ``planning``, ``checkpoint``,
``data_parallel``, ``overlap``, ``compat`` (``compat.fairscale``, ``compat.torch``) and
``integrations``, and the modules ``hybrid`` and ``testing`` (``docs/api.rst``;
``tests/test_public_api.py`` pins it). Everything else is internal.
"""

from typing import Any

from oss_plus import _moved
from oss_plus.amp.scaler import ShardedGradScaler
from oss_plus.checkpoint import load_checkpoint, save_checkpoint
from oss_plus.data_parallel import ShardedDataParallel
from oss_plus.hybrid import HybridGroups, hybrid_groups
from oss_plus.optimizer import OSS
from oss_plus.planning.partition import ParamSpec, Rule, assign_owners
from oss_plus.runtime.launch import DeviceChoice, choose_device
from oss_plus.state.subclass import register_state_class
from oss_plus.step.pieces import elementwise

__all__ = [
    "OSS",
    "DeviceChoice",
    "HybridGroups",
    "ParamSpec",
    "Rule",
    "ShardedDataParallel",
    "ShardedGradScaler",
    "assign_owners",
    "choose_device",
    "elementwise",
    "hybrid_groups",
    "load_checkpoint",
    "register_state_class",
    "save_checkpoint",
]
__version__ = "0.3.0"

_moved.install()


def __getattr__(name: str) -> Any:
    # the 0.2 module paths (oss_plus.plan, ...) until 0.4: oss_plus._moved
    return _moved.package_getattr(name)
