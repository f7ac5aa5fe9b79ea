"""Model section of the manifest: the LLM backbone and one encoder per modality (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from omni_trainer.components.flops import transformer_flops
from omni_trainer.config_base import Spec
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig

LLMPreset = Literal["tiny", "llama-7b", "llama-13b", "gpt-175b"]

# Public shapes: LLaMA (Touvron et al. 2023, Table 2), GPT-3 175B (Brown et al. 2020, Table 2.1).
_LLM_PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=344,
        vocab_size=512,
        gated_mlp=True,
        normalization="RMSNorm",
    ),
    "llama-7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        gated_mlp=True,
        normalization="RMSNorm",
    ),
    "llama-13b": dict(
        num_layers=40,
        hidden_size=5120,
        num_attention_heads=40,
        num_query_groups=40,
        ffn_hidden_size=13824,
        vocab_size=32000,
        gated_mlp=True,
        normalization="RMSNorm",
    ),
    "gpt-175b": dict(
        num_layers=96,
        hidden_size=12288,
        num_attention_heads=96,
        num_query_groups=96,
        ffn_hidden_size=49152,
        vocab_size=51200,
        gated_mlp=False,
        normalization="LayerNorm",
    ),
}
_LLM_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "gated_mlp",
    "normalization",
)


class LLMConfig(Spec):
    """The LLM backbone (megatron-core GPTModel). A preset fills every shape field left unset."""

    preset: LLMPreset | None = None
    num_layers: int | None = Field(None, ge=1)
    hidden_size: int | None = Field(None, ge=8)
    num_attention_heads: int | None = Field(None, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="GQA groups; = heads for MHA")
    ffn_hidden_size: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=16)
    gated_mlp: bool | None = Field(None, description="SwiGLU MLP (LLaMA) instead of GELU (GPT)")
    normalization: Literal["RMSNorm", "LayerNorm"] | None = None
    init_method_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _fill_from_preset(self) -> LLMConfig:
        base = _LLM_PRESETS.get(self.preset or "", {})
        for name in _LLM_SHAPE_FIELDS:
            if getattr(self, name) is None:
                if name not in base:
                    raise ValueError(
                        f"'{_camel(name)}' is required when no 'preset' is given "
                        f"(presets: {', '.join(_LLM_PRESETS)})"
                    )
                object.__setattr__(self, name, base[name])
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hiddenSize ({self.hidden_size}) must be a multiple of "
                f"numAttentionHeads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"numAttentionHeads ({self.num_attention_heads}) must be a multiple of "
                f"numQueryGroups ({self.num_query_groups})"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def flops(self, seq_lengths: Sequence[int], *, causal: bool = False) -> float:
        """Forward FLOPs over independent sequences (packed samples), LM head included."""
        return transformer_flops(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            gated_mlp=bool(self.gated_mlp),
            vocab_size=self.vocab_size,
            seq_lengths=seq_lengths,
            causal=causal,
        )


class EncodersConfig(Spec):
    """One encoder per modality. Every pipeline stage hosts the same set (DESIGN.md)."""

    image: VisionEncoderConfig | None = None
    audio: AudioEncoderConfig | None = None


class ModelConfig(Spec):
    llm: LLMConfig
    encoders: EncodersConfig = EncodersConfig()

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modalities this model can consume: text plus one per configured encoder."""
        return ("text", *(m for m in ("image", "audio") if getattr(self.encoders, m) is not None))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
