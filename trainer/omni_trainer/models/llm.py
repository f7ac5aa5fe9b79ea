"""The LLM backbone: megatron-core's GPTModel, built as released (local spec on CPU, TE on GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from omni_trainer.models.config import LLMConfig


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


NO_RECOMPUTE = Recompute()


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
    vp_stage: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute = NO_RECOMPUTE,
    sequence_parallel: bool = False,
):
    """Build one GPTModel chunk for this rank: its TP shard of the layers of its pipeline stage
    (and virtual stage ``vp_stage``), megatron's layer assignment. With context parallelism the
    core attention and RoPE are ``models.context_parallel``'s (adaptive sample sharding).

    ``params_dtype`` is the dtype of the weights and so of every activation, the pipeline's
    messages included (bf16: see ``components.precision``); ``recompute`` is megatron's
    activation recompute; ``sequence_parallel`` megatron's SP (``models.sequence_parallel``).
    Dropout is zero: the trainer's equivalence guarantees (a parallel run
    equals a single process) need every rank to compute the same function of the same data.
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
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,  # what the layers emit: no autocast around the LLM
        batch_p2p_comm=False,  # batched p2p + interleaving gives wrong grads on gloo (ENV.md)
        calculate_per_token_loss=True,  # the trainer pre-normalises by global text targets
        **_parallel_sizes(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=sequence_parallel,
        **recompute.megatron_kwargs(),
    )
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
        if sequence_parallel:
            from omni_trainer.models.sequence_parallel import local_block_spec

            spec = local_block_spec(spec, config, vp_stage)
    context_parallel = _context_parallel_size() > 1
    if context_parallel:
        from omni_trainer.models.context_parallel import context_parallel_spec

        spec = context_parallel_spec(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )
    if params_dtype != torch.float32:  # megatron's torch norms ignore params_dtype: cast them
        model.to(dtype=params_dtype)  # too, as megatron's Float16Module casts its whole module
    if context_parallel:
        from omni_trainer.models.context_parallel import use_positional_rope

        use_positional_rope(model)
    if sequence_parallel and pre_process:
        from omni_trainer.models.sequence_parallel import embed_whole_sequence

        embed_whole_sequence(model)
    return model


def _context_parallel_size() -> int:
    """megatron's CP group size (the model's config keeps cp = 1: see models.context_parallel)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_context_parallel_world_size()


def build_gpt_chunks(
    cfg: LLMConfig,
    *,
    max_sequence_length: int,
    seed: int,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute = NO_RECOMPUTE,
    sequence_parallel: bool = False,
) -> list:
    """All model chunks of this rank (one per virtual stage), initialised layout-independently."""
    from megatron.core import parallel_state as ps

    from omni_trainer.models.init import init_llm_chunk

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for c in range(vpp):
        vp_stage = c if vpp > 1 else None
        chunk = build_gpt(
            cfg,
            max_sequence_length=max_sequence_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            params_dtype=params_dtype,
            recompute=recompute,
            sequence_parallel=sequence_parallel,
        )
        init_llm_chunk(
            chunk,
            seed=seed,
            std=cfg.init_method_std,
            num_layers=cfg.num_layers,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
        )
        chunks.append(chunk)
    return chunks


def _parallel_sizes() -> dict[str, int | None]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": vpp if vpp and vpp > 1 else None,
    }
