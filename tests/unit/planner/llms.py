"""Small LLM shapes whose costs can be computed by hand in the planner tests."""

from __future__ import annotations

from typing import Any

from omni_trainer.models.config import LLMConfig


def plain_llm(**dims: Any) -> LLMConfig:
    """4 layers, width 64, 4 heads, GELU MLP 4h, LayerNorm, vocab 100 (override any)."""
    shape: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "ffn_hidden_size": 256,
        "vocab_size": 100,
        "gated_mlp": False,
        "normalization": "LayerNorm",
    }
    return LLMConfig(**{**shape, **dims})
