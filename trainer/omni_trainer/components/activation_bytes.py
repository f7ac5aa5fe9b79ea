"""Bytes a transformer keeps from forward to backward, per token (pure Python, no torch).

One formula for the planner's cost model and the trainer's ``auto`` memory budget.
"""

from __future__ import annotations

BF16 = 2
ACT_BYTES_PER_HIDDEN = 34
"""Korthikanti et al. 2022: bytes per token per hidden unit per layer kept for backward (bf16,
dropout masks included), with TP+SP and attention scores not stored."""


def kept_bytes_per_token(hidden: int, layers: int, *, full_recompute: bool = False) -> float:
    """Bytes per token kept for the backward by ``layers`` layers of width ``hidden``: 34 h per
    layer (selective recompute), or only each layer's bf16 input under full recompute."""
    return float((BF16 if full_recompute else ACT_BYTES_PER_HIDDEN) * hidden * layers)
