"""The LLM backbone: megatron-core's GPTModel, built as released (local spec on CPU, TE on GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_trainer.models.config import LLMConfig


def transformer_engine_usable() -> bool:
    """TE layers only where CUDA works and TE imports (a broken TE must never be touched)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_gpt(
    cfg: LLMConfig,
    *,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
):
    """Build the GPTModel for this rank (its TP shard; all layers while PP is 1).

    Dropout is zero: the trainer's equivalence guarantees (a parallel run equals a single process)
    need every rank to compute the same function of the same data.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    use_te = transformer_engine_usable()
    config = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        gated_linear_unit=cfg.gated_mlp,
        activation_func=F.silu if cfg.gated_mlp else F.gelu,
        add_bias_linear=not cfg.gated_mlp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=_tp_size(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
