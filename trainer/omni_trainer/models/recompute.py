"""Activation recompute (``train.recompute``), one setting for the LLM and the encoders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Recompute:
    """Activation recompute (``train.recompute``): none, selective (core attention) or full
    (whole layers: the first ``layers`` of each model chunk, all when None)."""

    mode: Literal["none", "selective", "full"] = "none"
    layers: int | None = None

    def megatron_kwargs(self) -> dict:
        if self.mode == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        if self.mode == "full":
            return {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": self.layers or 1 << 30,
            }
        return {}
