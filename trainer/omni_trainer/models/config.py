"""Model section of the manifest: the LLM backbone and one encoder per modality (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from omni_trainer.config_base import Spec
from omni_trainer.costs.flops import transformer_flops
from omni_trainer.interop.hf_config import SUPPORTED_LLMS, SUPPORTED_VLMS
from omni_trainer.models.encoders.config import (
    DEFER_HF,
    AudioEncoderConfig,
    VisionEncoderConfig,
    _camel,
    read_hf,
    refuse_beside_hf,
)

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


class RopeScaling(Spec):
    """RoPE frequency scaling as Hugging Face configs write it (``linear`` or Llama 3's)."""

    type: Literal["linear", "llama3"]
    factor: float = Field(..., gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: float = Field(8192, gt=0)


# Read from config.json when ``hf`` is given; setting one beside it is an error.
_HF_FIELDS = (
    *_LLM_SHAPE_FIELDS,
    "norm_epsilon",
    "rotary_base",
    "rope_scaling",
    "qkv_bias",
    "tie_embeddings",
    "sliding_window",
    "mrope_section",
)


class LLMConfig(Spec):
    """The LLM backbone (megatron-core GPTModel). A preset fills every shape field left unset;
    ``hf`` reads them all from a Hugging Face model's config.json and imports its weights."""

    hf: str | None = Field(
        None,
        description="a Hugging Face model (local directory or s3:// prefix) whose architecture "
        f"and weights the LLM takes (supported: {', '.join(SUPPORTED_LLMS)})",
    )
    preset: LLMPreset | None = None
    num_layers: int | None = Field(None, ge=1)
    hidden_size: int | None = Field(None, ge=8)
    num_attention_heads: int | None = Field(None, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="GQA groups; = heads for MHA")
    ffn_hidden_size: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=16)
    gated_mlp: bool | None = Field(None, description="SwiGLU MLP (LLaMA) instead of GELU (GPT)")
    normalization: Literal["RMSNorm", "LayerNorm"] | None = None
    norm_epsilon: float = Field(1e-5, gt=0)
    rotary_base: float = Field(10000.0, gt=0, description="RoPE theta")
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = Field(False, description="biases on Q, K, V (Qwen2)")
    tie_embeddings: bool = Field(False, description="the output layer reuses the embedding")
    sliding_window: int | None = Field(
        None, ge=1, description="attention window (Mistral); data.seqLength must not exceed it"
    )
    mrope_section: list[int] | None = Field(
        None,
        min_length=3,
        max_length=3,
        description="M-RoPE (Qwen2.5-VL): rotary channel pairs for time, height and width; "
        "media tokens take 3D positions",
    )
    init_method_std: float = Field(0.02, gt=0)
    freeze: bool = Field(False, description="train none of the LLM's weights")

    @model_validator(mode="after")
    def _fill_from_preset(self, info: ValidationInfo) -> LLMConfig:
        if self.hf is not None:
            refuse_beside_hf(self, {"preset", *_HF_FIELDS})
            if (info.context or {}).get(DEFER_HF):
                return self  # dimensions unknown here: see DEFER_HF
            self._fill_from_hf()
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

    def _fill_from_hf(self) -> None:
        from omni_trainer.interop.hf_config import llm_fields

        for name, value in read_hf(self.hf, llm_fields).items():
            if name == "rope_scaling" and value is not None:
                value = RopeScaling.model_validate(value)
            object.__setattr__(self, name, value)

    @property
    def resolved(self) -> bool:
        """Whether the dimensions are known (false only for ``hf`` under :data:`DEFER_HF`)."""
        return self.num_layers is not None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def flops(self, seq_lengths: Sequence[int], *, causal: bool = True) -> float:
        """Forward FLOPs over independent sequences (packed samples), LM head included; causal
        attention counts half of each square, as ``costs.flops.MFU_CONVENTION`` says."""
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
    """One encoder per modality. Every pipeline stage hosts the same set (encoders are colocated
    on every stage)."""

    image: VisionEncoderConfig | None = None
    audio: AudioEncoderConfig | None = None

    def items(self) -> list[tuple[str, VisionEncoderConfig | AudioEncoderConfig]]:
        """(modality, config) of each configured encoder."""
        return [(m, e) for m in ("image", "audio") if (e := getattr(self, m)) is not None]


class ProjectorConfig(Spec):
    """The MLP from one encoder's width to the LLM's."""

    freeze: bool = Field(False, description="train none of the projector's weights")


class ProjectorsConfig(Spec):
    """One projector per encoder (LLaVA's two-stage recipe trains them alone first)."""

    image: ProjectorConfig = ProjectorConfig()
    audio: ProjectorConfig = ProjectorConfig()


# What may stand beside ``model.hf`` (how to train the VLM's parts, not what they are).
_BESIDE_VLM = {"llm": {"freeze"}, "image": {"freeze", "freezeLayers", "freeze_layers"}}


class ModelConfig(Spec):
    hf: str | None = Field(
        None,
        description="a Hugging Face VLM (local directory or s3:// prefix; supported: "
        f"{', '.join(SUPPORTED_VLMS)}) whose language model, vision tower, projector, "
        "tokenizer and image processor the model takes; beside it only freeze settings",
    )
    llm: LLMConfig
    encoders: EncodersConfig = EncodersConfig()
    projectors: ProjectorsConfig = ProjectorsConfig()

    @model_validator(mode="before")
    @classmethod
    def _expand_vlm(cls, data: Any) -> Any:
        """``hf`` becomes ``llm.hf`` and ``encoders.image.hf`` (each reads its part of the VLM's
        config.json), after refusing what the VLM defines."""
        if not isinstance(data, dict) or data.get("hf") is None:
            return data
        hf = data["hf"]
        llm = dict(data.get("llm") or {})
        encoders = dict(data.get("encoders") or {})
        image = dict(encoders.get("image") or {})
        explicit = [f"llm.{k}" for k in llm if k not in _BESIDE_VLM["llm"]]
        explicit += [f"encoders.image.{k}" for k in image if k not in _BESIDE_VLM["image"]]
        if explicit:
            raise ValueError(
                f"{', '.join(explicit)} cannot be set beside 'hf': the VLM's parts come from "
                f"{hf}/config.json (only freeze settings may be given; remove them, or drop 'hf')"
            )
        encoders["image"] = image | {"hf": hf}
        return data | {"llm": llm | {"hf": hf}, "encoders": encoders}

    def unread_hf(self) -> list[tuple[str, Spec]]:
        """(field path, section) of every ``hf`` left unread under ``DEFER_HF``."""
        parts = [("llm", self.llm), *((f"encoders.{m}", e) for m, e in self.encoders.items())]
        return [(path, part) for path, part in parts if not part.resolved]

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modalities this model can consume: text plus one per configured encoder."""
        return ("text", *(m for m in ("image", "audio") if getattr(self.encoders, m) is not None))
