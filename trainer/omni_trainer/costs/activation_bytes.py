"""Bytes a transformer keeps from forward to backward, per token (pure Python, no torch).

One formula for the planner's cost model and the trainer's ``auto`` memory budget.
"""

from __future__ import annotations

BF16 = 2
ACT_BYTES_PER_HIDDEN = 34
"""Korthikanti et al. 2022: bytes per token per hidden unit per layer kept for backward (bf16,
dropout masks included), with TP+SP and attention scores not stored."""
ACT_BYTES_REPLICATED = 10
"""Of those, the bytes every TP rank keeps whole without sequence parallelism (norms, dropouts,
residuals: ``10 s b h + 24 s b h / t``, Korthikanti Table 2 without the attention scores)."""


def kept_bytes_per_token(
    hidden: int,
    layers: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = True,
    full_recompute: bool = False,
) -> float:
    """Bytes per token one of ``tp`` tensor-parallel ranks keeps for the backward of ``layers``
    layers of width ``hidden``: 34 h / t per layer (selective recompute), or only each layer's
    bf16 input under full recompute. Without sequence parallelism (tp > 1) the norm, dropout and
    residual bytes and the layer inputs are whole on every rank."""
    sharded = sequence_parallel or tp == 1
    if full_recompute:
        per_hidden = BF16 / (tp if sharded else 1)
    elif sharded:
        per_hidden = ACT_BYTES_PER_HIDDEN / tp
    else:
        per_hidden = ACT_BYTES_REPLICATED + (ACT_BYTES_PER_HIDDEN - ACT_BYTES_REPLICATED) / tp
    return float(per_hidden * hidden * layers)
