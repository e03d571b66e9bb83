"""oss_plus: sharded optimizer state (ZeRO stage 1) on torch.distributed."""

from oss_plus.amp import ShardedGradScaler
from oss_plus.checkpoint import load_checkpoint, save_checkpoint
from oss_plus.data_parallel import ShardedDataParallel
from oss_plus.hybrid import HybridGroups, hybrid_groups
from oss_plus.optimizer import OSS
from oss_plus.partition import ParamSpec, Rule, assign_owners
from oss_plus.pieces import elementwise

__all__ = [
    "OSS",
    "HybridGroups",
    "ParamSpec",
    "Rule",
    "ShardedDataParallel",
    "ShardedGradScaler",
    "assign_owners",
    "elementwise",
    "hybrid_groups",
    "load_checkpoint",
    "save_checkpoint",
]
__version__ = "0.2.0"
