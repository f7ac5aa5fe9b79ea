"""Workload balancing (the paper's technique 7): cost models, k-way partitioning, grouped
reordering, and LSSP (which rank of a sequence-parallel group encodes which encoder sample).

Pure Python (no torch): the data loader calls it between a metadata all-gather and an all-to-all,
and benchmarks and tests run it on CPU.
"""

from omni_trainer.balance.cost import EncoderCost, cost_from_config, cost_from_llm_config
from omni_trainer.balance.partition import (
    Partition,
    greedy_lpt,
    improve_by_swaps,
    karmarkar_karp,
    lower_bound,
    no_reorder,
)
from omni_trainer.balance.reorder import (
    ItemMeta,
    ReorderPlan,
    group_of,
    modality_cost,
    plan_reorder,
    split_groups,
)

__all__ = [
    "EncoderCost",
    "ItemMeta",
    "Partition",
    "ReorderPlan",
    "cost_from_config",
    "cost_from_llm_config",
    "greedy_lpt",
    "group_of",
    "improve_by_swaps",
    "karmarkar_karp",
    "lower_bound",
    "modality_cost",
    "no_reorder",
    "plan_reorder",
    "split_groups",
]
