"""HF ``config.json`` -> our LLM config fields (torch-free: the manifest validates with it).

Supported decoder-only families share Llama's layout (RMSNorm, SwiGLU, RoPE, GQA); Qwen2 adds
QKV biases and often ties embeddings, Mistral may use a sliding window.
"""

from __future__ import annotations

from typing import Any

from omni_trainer.interop.source import HFModelError

SUPPORTED_LLMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
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
    if kind not in _ROPE_TYPES:
        raise HFModelError(
            f"{where}: rope type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})"
        )
    if kind == "default":
        return theta, None
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"type": kind, **{k: float(scaling[k]) for k in keep if k in scaling}}


def llm_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The LLM config fields (snake_case) a Llama/Mistral/Qwen2 ``config.json`` describes."""
    arch = architecture(config, where)
    if arch not in SUPPORTED_LLMS:
        raise HFModelError(
            f"{where}: architecture {arch!r} is not supported as model.llm.hf "
            f"(supported: {', '.join(SUPPORTED_LLMS)})"
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
    )
