"""An independent reference for the LLM every layout is compared against: HF transformers' Llama.

Our single-process GPTModel (megatron-core, local spec) with its weights copied into a
``LlamaForCausalLM`` (eager attention, fp32) gives the same logits and per-token losses, on a
packed row of two samples (their boundaries as megatron's PackedSeqParams) against each sample
run alone by transformers. A bug shared by every
layout (the equivalence tests compare layouts with each other) shows here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from omni_trainer.models.config import LLMConfig
from omni_trainer.models.llm import build_gpt
from omni_trainer.models.packed import pack_boundaries


def _llama_from(model, cfg: LLMConfig):
    """transformers' Llama holding ``model``'s weights (megatron's fused layouts unpacked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    d = cfg.hidden_size // heads
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=groups,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    ).eval()
    sd = {k: v.detach() for k, v in model.state_dict().items() if v is not None}
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
        "lm_head.weight": sd["output_layer.weight"],
    }
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        # megatron's fused QKV: per query group, its query heads, then one key and one value head
        qkv = sd[src + "self_attention.linear_qkv.weight"].view(groups, heads // groups + 2, d, -1)
        q, k, v = qkv.split([heads // groups, 1, 1], dim=1)
        gate, up = sd[src + "mlp.linear_fc1.weight"].chunk(2)
        out |= {
            dst + "input_layernorm.weight": sd[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q.reshape(heads * d, -1),
            dst + "self_attn.k_proj.weight": k.reshape(groups * d, -1),
            dst + "self_attn.v_proj.weight": v.reshape(groups * d, -1),
            dst + "self_attn.o_proj.weight": sd[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": sd[src + "pre_mlp_layernorm.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": sd[src + "mlp.linear_fc2.weight"],
        }
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def test_single_process_model_equals_transformers_llama(single_rank) -> None:
    cfg = LLMConfig(preset="tiny")
    model = build_gpt(cfg, max_sequence_length=64).eval()
    hf = _llama_from(model, cfg)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in (10, 14)]
    packed = torch.cat(samples, dim=1)
    boundaries = pack_boundaries(np.array([[0] * 10 + [1] * 14]), torch.device("cpu"))
    # positions restart in every sample, as the packer writes them
    positions = torch.cat([torch.arange(s.shape[1]) for s in samples])[None]
    labels = torch.roll(packed, -1, dims=1)
    with torch.no_grad():
        kw = {"input_ids": packed, "position_ids": positions, "attention_mask": None}
        logits = model(**kw, packed_seq_params=boundaries)
        losses = model(**kw, packed_seq_params=boundaries, labels=labels)
        start = 0
        for s in samples:
            n = s.shape[1]
            ref = hf(input_ids=s).logits
            torch.testing.assert_close(logits[:, start : start + n], ref, atol=1e-5, rtol=1e-5)
            ref_loss = F.cross_entropy(ref[0, :-1], s[0, 1:], reduction="none")
            ours = losses[0, start : start + n - 1]
            torch.testing.assert_close(ours, ref_loss, atol=1e-5, rtol=1e-5)
            start += n
    assert logits.abs().max() > 0.1  # real logits, not a degenerate zero model
