"""The LLM backbone: megatron-core's GPTModel, built as released (local spec on CPU, TE on GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from omni_trainer.models.config import LLMConfig
from omni_trainer.models.recompute import Recompute


@dataclass(frozen=True)
class LLMRuntime:
    """How a run builds the LLM beyond its architecture (``train`` and ``parallelism``): the
    weights' dtype (so every activation's and the pipeline's: bf16 in ``components.precision``),
    megatron's activation recompute, and sequence parallelism (``models.sequence_parallel``)."""

    params_dtype: torch.dtype = torch.float32
    recompute: Recompute = field(default_factory=Recompute)
    sequence_parallel: bool = False
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """megatron's layer spec: ``auto`` is TE's where CUDA and TE work, the local one otherwise;
    ``local`` / ``te`` force one (``bench/gpu_check.py`` compares them on one GPU)."""


FP32 = LLMRuntime()


def transformer_engine_usable() -> bool:
    """TE layers only where CUDA works and TE imports (a broken TE must never be touched)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _uses_te(layer_spec: str) -> bool:
    if layer_spec == "te" and not transformer_engine_usable():
        raise RuntimeError("layer_spec 'te' needs CUDA and an importable TransformerEngine")
    return layer_spec == "te" or (layer_spec == "auto" and transformer_engine_usable())


def build_gpt(
    cfg: LLMConfig,
    *,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    runtime: LLMRuntime = FP32,
):
    """Build one GPTModel chunk for this rank: its TP shard of the layers of its pipeline stage
    (and virtual stage ``vp_stage``), megatron's layer assignment. Packed samples are separated
    by ``packed_seq_params`` (``models.packed``: TE's varlen attention on GPU, per-sample SDPA
    on the local spec). With context parallelism the core attention and RoPE are
    ``models.context_parallel``'s (adaptive sample sharding).

    ``runtime`` says the weights' dtype, the recompute and whether sequence parallelism runs.
    Dropout is zero: the trainer's equivalence guarantees (a parallel run
    equals a single process) need every rank to compute the same function of the same data.
    """
    from megatron.core.models.gpt import GPTModel

    use_te = _uses_te(runtime.layer_spec)
    params_dtype = runtime.params_dtype
    if cfg.sliding_window is not None and max_sequence_length > cfg.sliding_window:
        raise ValueError(
            f"data.seqLength ({max_sequence_length}) exceeds the model's sliding window "
            f"({cfg.sliding_window}), which this trainer does not implement; lower seqLength"
        )
    config = _transformer_config(cfg, runtime=runtime, use_te=use_te)
    context_parallel = _context_parallel_size() > 1
    spec = _layer_spec(
        cfg,
        config,
        use_te=use_te,
        sequence_parallel=runtime.sequence_parallel,
        context_parallel=context_parallel,
        vp_stage=vp_stage,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(cfg.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope" if cfg.mrope_section is None else "mrope",
        rotary_base=cfg.rotary_base,
        vp_stage=vp_stage,
    )
    _scale_rope(model, cfg)
    if post_process:
        _mask_padded_logits(model, cfg.vocab_size)
    if params_dtype != torch.float32:  # megatron's torch norms ignore params_dtype: cast them
        model.to(dtype=params_dtype)  # too, as megatron's Float16Module casts its whole module
    if context_parallel:
        from omni_trainer.models.context_parallel import use_positional_rope

        use_positional_rope(model)
    return model


def _transformer_config(cfg: LLMConfig, *, runtime: LLMRuntime, use_te: bool):
    """megatron's TransformerConfig of the architecture under ``runtime``, with this process's
    parallel sizes; no dropout, no fusions the local spec lacks."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = runtime.params_dtype
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        gated_linear_unit=cfg.gated_mlp,
        activation_func=F.silu if cfg.gated_mlp else F.gelu,
        add_bias_linear=not cfg.gated_mlp,
        add_qkv_bias=cfg.qkv_bias,
        layernorm_epsilon=cfg.norm_epsilon,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,  # what the layers emit: no autocast around the LLM
        # batched p2p + interleaving gives wrong grads on gloo (measured)
        batch_p2p_comm=False,
        calculate_per_token_loss=True,  # the trainer pre-normalises by global text targets
        **_parallel_sizes(),
        bias_dropout_fusion=False,  # megatron's jit-fused paths: never compiled here
        bias_activation_fusion=False,  # (omni_trainer.megatron_imports)
        masked_softmax_fusion=False,
        # TE's fused THD RoPE: no host sync per layer on GPU; it reads each sample's angles
        # from position 0, so M-RoPE's per-token angles take megatron's unfused THD path
        apply_rope_fusion=use_te and cfg.mrope_section is None,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=runtime.sequence_parallel,
        mrope_section=cfg.mrope_section,
        **runtime.recompute.megatron_kwargs(),
    )


def _layer_spec(
    cfg: LLMConfig,
    config,
    *,
    use_te: bool,
    sequence_parallel: bool,
    context_parallel: bool,
    vp_stage: int | None,
):
    """The transformer layer spec: TE's, or the local one with packed-sample attention (and
    this trainer's sequence-parallel block); context parallelism's core attention on top."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from omni_trainer.models.packed import PackedAttention, with_core_attention

    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = with_core_attention(
            get_gpt_layer_local_spec(normalization=cfg.normalization), PackedAttention
        )
        if sequence_parallel:
            from omni_trainer.models.sequence_parallel import local_block_spec

            spec = local_block_spec(spec, config, vp_stage)
    if context_parallel:
        from omni_trainer.models.context_parallel import ContextParallelAttention

        spec = with_core_attention(spec, ContextParallelAttention)
    return spec


def tied_embedding_copies(chunks: list) -> list:
    """With tied embeddings and several pipeline stages, the first stage's embedding and the last
    stage's output layer are two copies of one weight: this stage's copies (none at pp 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return []
    return [
        chunk.shared_embedding_or_output_weight()
        for chunk in chunks
        if chunk.share_embeddings_and_output_weights and (chunk.pre_process or chunk.post_process)
    ]


def all_reduce_tied_embedding_grads(chunks: list, *, grad_of=lambda p: p.grad) -> None:
    """Sum the gradients (``grad_of``: the fp32 main gradient) of the :func:`tied_embedding_copies`
    over megatron's embedding group so both copies take the step a single process would. After a
    ZeRO-1 reduce-scatter only this rank's rows are right, and they are the same rows on both
    stages (the copy takes a bucket of its own)."""
    from megatron.core import parallel_state as ps

    from omni_trainer.distributed import comm

    for weight in tied_embedding_copies(chunks):
        grad = grad_of(weight)
        if grad is not None:  # None: the LLM is frozen
            comm.all_reduce(grad, group=ps.get_embedding_group())


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of TP (megatron's vocab-parallel layers need it);
    the padded logits are masked out, so the loss is the unpadded model's at every TP size."""
    return -(-vocab_size // tp) * tp


def _mask_padded_logits(model, vocab_size: int) -> None:
    """Give the padding rows of the output layer a logit of -inf-ish: no probability, no
    gradient, so a TP size that pads trains exactly like one that does not."""
    from megatron.core import parallel_state as ps

    local = model.output_layer.output_size_per_partition
    start = ps.get_tensor_model_parallel_rank() * local if ps.model_parallel_is_initialized() else 0
    if start + local <= vocab_size:
        return
    keep = (torch.arange(start, start + local) < vocab_size).float()

    def mask(_module, _inputs, output):
        logits, bias = output
        pad = (1.0 - keep.to(logits.device, logits.dtype)) * torch.finfo(logits.dtype).min
        return logits * keep.to(logits.device, logits.dtype) + pad, bias

    model.output_layer.register_forward_hook(mask)


def _scale_rope(model, cfg: LLMConfig) -> None:
    """RoPE frequency scaling as HF computes it (megatron's built-in Llama 3 scaling has fixed
    constants); megatron computes cos/sin lazily, so replacing ``inv_freq`` here is enough."""
    scaling = cfg.rope_scaling
    rotary = getattr(model, "rotary_pos_emb", None)
    if scaling is None or rotary is None:
        return
    if scaling.type == "linear":
        rotary.inv_freq = rotary.inv_freq / scaling.factor
    else:
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq,
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )


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
    runtime: LLMRuntime = FP32,
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
            runtime=runtime,
        )
        init_llm_chunk(
            chunk,
            seed=seed,
            std=cfg.init_method_std,
            num_layers=cfg.num_layers,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
        )
        if cfg.hf is not None:
            from omni_trainer.interop.llm import load_llm_chunk

            load_llm_chunk(
                chunk,
                cfg,
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
