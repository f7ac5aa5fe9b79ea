"""HF ``config.json`` -> our LLM config fields (torch-free: the manifest validates with it).

Supported decoder-only families share Llama's layout (RMSNorm, SwiGLU, RoPE, GQA); Qwen2 adds
QKV biases and often ties embeddings, Mistral may use a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_trainer.interop import qwen2_5_vl
from omni_trainer.interop.source import HFModelError

SUPPORTED_LLMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_VLMS = ("LlavaForConditionalGeneration", qwen2_5_vl.VLM)
_TEXT_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_ROPE_TYPES = ("default", "linear", "llama3")


def architecture(config: dict[str, Any], where: str) -> str:
    archs = config.get("architectures") or []
    if len(archs) != 1:
        raise HFModelError(f"{where}: config.json must name one architecture, found {archs}")
    return archs[0]


def rope_settings(config: dict[str, Any], where: str) -> tuple[float, dict[str, float] | None]:
    """(rope theta, scaling or None) from a v5 ``rope_parameters`` or a v4 ``rope_theta`` +
    ``rope_scaling`` config."""
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = params or dict(config.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind not in (*_ROPE_TYPES, "mrope"):
        raise HFModelError(
            f"{where}: rope type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})"
        )
    if kind in ("default", "mrope"):  # M-RoPE's sections: qwen2_5_vl.mrope_section
        return theta, None
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"type": kind, **{k: float(scaling[k]) for k in keep if k in scaling}}


def vlm_text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A LLaVA ``config.json``'s language model as a causal LM's config.json, after checking
    the parts of the VLM this trainer builds (an MLP projector with biases and GELU)."""
    if config.get("projector_hidden_act", "gelu") != "gelu":
        raise HFModelError(
            f"{where}: projector_hidden_act {config['projector_hidden_act']!r} (only gelu)"
        )
    if not config.get("multimodal_projector_bias", True):
        raise HFModelError(f"{where}: multimodal_projector_bias false is not supported")
    if not isinstance(config.get("vision_feature_layer", -2), int):
        raise HFModelError(f"{where}: several vision_feature_layer values are not supported")
    text = dict(config["text_config"])
    kind = text.get("model_type")
    if kind not in _TEXT_ARCHS:
        raise HFModelError(
            f"{where}: text_config.model_type {kind!r} is not supported in a VLM "
            f"(supported: {', '.join(_TEXT_ARCHS)})"
        )
    tied = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return text | {"architectures": [_TEXT_ARCHS[kind]], "tie_word_embeddings": tied}


def llm_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The LLM config fields (snake_case) a Llama/Mistral/Qwen2 ``config.json`` describes (or
    the language model of a LLaVA one)."""
    arch = architecture(config, where)
    if arch == qwen2_5_vl.VLM:
        config = qwen2_5_vl.text_config(config)
        arch = config["architectures"][0]
    elif arch in SUPPORTED_VLMS:
        config = vlm_text_config(config, where)
        arch = config["architectures"][0]
    if arch not in SUPPORTED_LLMS:
        raise HFModelError(
            f"{where}: architecture {arch!r} is not supported as model.llm.hf "
            f"(supported: {', '.join(SUPPORTED_LLMS)}; and as model.hf: "
            f"{', '.join(SUPPORTED_VLMS)})"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise HFModelError(f"{where}: hidden_act {config['hidden_act']!r} (only silu is supported)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise HFModelError(f"{where}: attention_bias/mlp_bias are not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise HFModelError(
            f"{where}: head_dim {head_dim} x {heads} heads != hidden_size {hidden} "
            "(a decoupled head_dim is not supported)"
        )
    theta, scaling = rope_settings(config, where)
    use_window = config.get("use_sliding_window", arch == "MistralForCausalLM")
    return dict(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        gated_mlp=True,
        normalization="RMSNorm",
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        rotary_base=theta,
        rope_scaling=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=int(config["sliding_window"])
        if use_window and config.get("sliding_window")
        else None,
        mrope_section=qwen2_5_vl.mrope_section(config, where),
    )


# -- encoders -------------------------------------------------------------------------------------

SUPPORTED_VISION = (
    "CLIPModel",
    "CLIPVisionModel",
    "SiglipModel",
    "SiglipVisionModel",
    *qwen2_5_vl.ARCHITECTURES,
)
SUPPORTED_AUDIO = ("WhisperForConditionalGeneration", "WhisperModel")
_VISION_TYPES = {
    "clip": "clip",
    "clip_vision_model": "clip",
    "siglip": "siglip",
    "siglip_vision_model": "siglip",
}
# transformers' config defaults, for keys a config.json leaves out.
_VISION_DEFAULTS = {
    "clip": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    ),
    "siglip": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    ),
}
_ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class HFTower:
    """What an imported encoder's config.json says beyond the manifest's shape fields."""

    family: str
    """``clip``, ``siglip``, ``qwen2_5_vl`` or ``whisper``: the module and weight map the tower
    uses."""
    total_layers: int
    """Layers in the checkpoint (the model builds only those up to its feature layer)."""
    norm_epsilon: float
    activation: str
    """The HF ``hidden_act`` / ``activation_function`` name."""
    image_size: int = 0
    """Vision: the side the position table was trained for (other sizes interpolate it)."""
    max_positions: int = 0
    """Audio: the longest clip in encoder positions (Whisper's ``max_source_positions``)."""
    qwen: qwen2_5_vl.QwenVision | None = None
    """Qwen2.5-VL: patch merging, windows, 2D rotary (None for the other families)."""

    @property
    def output_size(self) -> int | None:
        """Width of the tower's output when it is not the blocks' (Qwen2.5-VL's merger)."""
        return self.qwen.out_hidden_size if self.qwen else None

    @property
    def class_token(self) -> bool:
        """CLIP prepends a class token to the patches; SigLIP does not."""
        return self.family == "clip"


def _checked_activation(name: str, where: str) -> str:
    if name not in _ACTIVATIONS:
        raise HFModelError(
            f"{where}: activation {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    return name


def feature_layers(total: int, feature_layer: int, where: str) -> int:
    """Blocks to build for LLaVA's ``vision_feature_layer`` (an index into the tower's hidden
    states: 0 = the embeddings, -1 = the last block's output)."""
    built = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
    if not 1 <= built <= total:
        raise HFModelError(
            f"{where}: featureLayer {feature_layer} selects no block of a {total}-layer tower "
            f"(allowed: 1..{total} or -{total}..-1)"
        )
    return built


def vlm_feature_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A VLM's ``featureLayer`` / ``featureSelect`` (the layer its projector was trained on);
    empty for a vision model's own config."""
    if "vision_feature_layer" not in config and "vision_feature_select_strategy" not in config:
        return {}
    select = config.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise HFModelError(f"vision_feature_select_strategy {select!r} (default or full)")
    return {"feature_layer": int(config.get("vision_feature_layer", -2)), "feature_select": select}


def vision_fields(
    config: dict[str, Any], where: str, *, feature_layer: int
) -> tuple[dict[str, Any], HFTower]:
    """Our vision encoder's shape fields and the tower's settings from a CLIP / SigLIP
    config.json (a dual encoder's or a VLM's ``vision_config``, a vision-only model's keys), or
    a Qwen2.5-VL tower's (every block is built: ``feature_layer`` does not apply)."""
    if qwen2_5_vl.is_qwen_vision(config):
        fields, act, qwen = qwen2_5_vl.vision_fields(config, where)
        tower = HFTower(
            family=qwen2_5_vl.FAMILY,
            total_layers=fields["num_layers"],
            norm_epsilon=1e-6,
            activation=act,
            qwen=qwen,
        )
        return fields, tower
    vision = config.get("vision_config") or config
    kind = _VISION_TYPES.get(str(vision.get("model_type", config.get("model_type"))))
    if kind is None:
        archs = config.get("architectures") or [config.get("model_type")]
        raise HFModelError(
            f"{where}: {archs[0]!r} is not supported as an image encoder "
            f"(supported: {', '.join(SUPPORTED_VISION)})"
        )
    v = {**_VISION_DEFAULTS[kind], **{k: x for k, x in vision.items() if x is not None}}
    total = int(v["num_hidden_layers"])
    tower = HFTower(
        family=kind,
        total_layers=total,
        norm_epsilon=float(v["layer_norm_eps"]),
        activation=_checked_activation(str(v["hidden_act"]), where),
        image_size=int(v["image_size"]),
    )
    fields = dict(
        hidden_size=int(v["hidden_size"]),
        num_layers=feature_layers(total, feature_layer, where),
        num_heads=int(v["num_attention_heads"]),
        ffn_hidden_size=int(v["intermediate_size"]),
        patch_size=int(v["patch_size"]),
        in_channels=int(v.get("num_channels", 3)),
    )
    return fields, tower


def audio_fields(config: dict[str, Any], where: str) -> tuple[dict[str, Any], HFTower]:
    """Our audio encoder's shape fields and the tower's settings from a Whisper config.json."""
    if config.get("model_type") != "whisper":
        archs = config.get("architectures") or [config.get("model_type")]
        raise HFModelError(
            f"{where}: {archs[0]!r} is not supported as an audio encoder "
            f"(supported: {', '.join(SUPPORTED_AUDIO)})"
        )
    tower = HFTower(
        family="whisper",
        total_layers=int(config["encoder_layers"]),
        norm_epsilon=1e-5,
        activation=_checked_activation(str(config.get("activation_function", "gelu")), where),
        max_positions=int(config.get("max_source_positions", 1500)),
    )
    fields = dict(
        hidden_size=int(config["d_model"]),
        num_layers=tower.total_layers,
        num_heads=int(config["encoder_attention_heads"]),
        ffn_hidden_size=int(config["encoder_ffn_dim"]),
        n_mels=int(config.get("num_mel_bins", 80)),
        subsampling=2,
    )
    return fields, tower
