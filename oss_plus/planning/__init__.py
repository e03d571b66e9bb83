"""Planning (PURE): who owns which parameter, the shard plan as a frozen value, the policies
the adapters customise it with, and the reports of ``oss-plus plan``. Nothing here talks to
other ranks or imports ``torch.distributed`` (an import-linter contract and a test keep it so).

Public API: the names below (``docs/api.rst``).
"""

from oss_plus.planning.model_specs import (
    MODELS,
    gpt2_shapes,
    llama_shapes,
    model_specs,
    parse_shapes,
    read_shapes,
    specs_from_module,
    specs_from_shapes,
)
from oss_plus.planning.muon import (
    MUON_STATE,
    CostRow,
    MuonSplit,
    cost_rows,
    muon_scale_rows,
    rank_flops,
    split_for_muon,
)
from oss_plus.planning.ns_cost import ns_flops
from oss_plus.planning.optim_state import OPTIMIZER_STATES, OptimizerState, optimizer_state
from oss_plus.planning.partition import ParamSpec, Piece, Rule, assign_owners
from oss_plus.planning.plan import ShardPlan, make_plan, plan_from_owners
from oss_plus.planning.policy import Layout, LocalOrder, ShardPolicy, Transport
from oss_plus.planning.report import BalanceRow, balance_rows, default_shard_sizes
from oss_plus.planning.scale import (
    ScaleRow,
    Topology,
    rank_loads,
    rank_numels,
    ring_bytes,
    scale_rows,
)

__all__ = [
    "MODELS",
    "MUON_STATE",
    "OPTIMIZER_STATES",
    "BalanceRow",
    "CostRow",
    "Layout",
    "LocalOrder",
    "MuonSplit",
    "OptimizerState",
    "ParamSpec",
    "Piece",
    "Rule",
    "ScaleRow",
    "ShardPlan",
    "ShardPolicy",
    "Topology",
    "Transport",
    "assign_owners",
    "balance_rows",
    "cost_rows",
    "default_shard_sizes",
    "gpt2_shapes",
    "llama_shapes",
    "make_plan",
    "model_specs",
    "muon_scale_rows",
    "ns_flops",
    "optimizer_state",
    "parse_shapes",
    "plan_from_owners",
    "rank_flops",
    "rank_loads",
    "rank_numels",
    "read_shapes",
    "ring_bytes",
    "scale_rows",
    "specs_from_module",
    "split_for_muon",
    "specs_from_shapes",
]
