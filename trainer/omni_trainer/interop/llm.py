"""The LLM's HF <-> megatron weight map (Llama / Mistral / Qwen2 names), used by import and
export alike.

A megatron GPTModel parameter (by its global name, ``models.init.global_llm_names``) is built
from one or more HF tensors in one of five ways:

* ``copy``: replicated over TP (norms);
* ``rows``: split along dim 0 over TP; the vocabulary (embedding, output layer) is padded to a
  multiple of TP with zero rows;
* ``cols``: split along dim 1 over TP (row-parallel ``linear_proj``, ``linear_fc2``);
* ``qkv``: megatron's fused, grouped layout: for each KV group g, the queries of its heads, then
  its key, then its value; TP rank r holds the groups [r*G/TP, (r+1)*G/TP);
* ``gate_up``: SwiGLU's ``linear_fc1`` = [gate; up] per TP shard (stride 2).

Each rank reads only the rows or columns of its own shard (``SafetensorsReader``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from omni_trainer.interop.source import HFModelError
from omni_trainer.models.config import LLMConfig

Kind = Literal["copy", "rows", "cols", "qkv", "gate_up"]


@dataclass(frozen=True)
class HFNames:
    """Where an LLM's tensors sit in an HF checkpoint (LLaVA nests them under a prefix)."""

    model: str = "model."
    head: str = "lm_head.weight"


def hf_names_of(reader) -> HFNames:
    """Where a checkpoint holds its language model: a causal LM's ``model.*`` + ``lm_head``, or
    a LLaVA's ``language_model.model.*`` + ``language_model.lm_head`` (transformers 4) or
    ``model.language_model.*`` + ``lm_head`` (5); a tied model may have no head."""
    model = reader.prefix_of("embed_tokens.weight", "language model")
    heads = [k for k in reader.keys() if k.endswith("lm_head.weight")]  # noqa: SIM118
    return HFNames(model=model, head=heads[0] if len(heads) == 1 else HFNames.head)


@dataclass(frozen=True)
class TensorMap:
    kind: Kind
    hf: tuple[str, ...]


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_MAP: dict[str, tuple[Kind, tuple[str, ...]]] = {
    # canonical names (``models.spec_names``): TE's fused norms arrive under these too
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.linear_proj.weight": ("cols", ("self_attn.o_proj.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("cols", ("mlp.down_proj.weight",)),
}


def tensor_map(name: str, cfg: LLMConfig, names: HFNames = HFNames()) -> TensorMap:
    """The HF tensors behind the megatron parameter ``name`` (a global name)."""
    embed = f"{names.model}embed_tokens.weight"
    if name == "embedding.word_embeddings.weight":
        return TensorMap("rows", (embed,))
    if name == "output_layer.weight":
        return TensorMap("rows", (embed if cfg.tie_embeddings else names.head,))
    if name == "decoder.final_layernorm.weight":
        return TensorMap("copy", (f"{names.model}norm.weight",))
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_MAP:
        raise HFModelError(f"no Hugging Face tensor maps to the LLM parameter {name!r}")
    kind, hf = _LAYER_MAP[m.group(2)]
    prefix = f"{names.model}layers.{m.group(1)}."
    return TensorMap(kind, tuple(prefix + h for h in hf))


def hf_shapes(cfg: LLMConfig, tm: TensorMap) -> list[list[int]]:
    """The full shape of each HF tensor of ``tm``, as the config says it must be."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    out = []
    for name in tm.hf:
        bias = name.endswith(".bias")
        if name.endswith("embed_tokens.weight") or tm.kind == "rows":
            shape = [cfg.vocab_size, h]
        elif tm.kind == "copy":
            shape = [h]
        elif tm.kind == "qkv":
            rows = q if ".q_proj." in name else kv
            shape = [rows] if bias else [rows, h]
        elif tm.kind == "gate_up":
            shape = [cfg.ffn_hidden_size, h]
        else:  # cols
            shape = [h, q if ".o_proj." in name else cfg.ffn_hidden_size]
        out.append(shape)
    return out


def expected_hf_shapes(cfg: LLMConfig, names: HFNames) -> dict[str, list[int]]:
    """Every HF tensor the LLM reads, with the full shape its config says it has."""
    ours = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not cfg.tie_embeddings:
        ours.append("output_layer.weight")
    for i in range(cfg.num_layers):
        ours += [
            f"decoder.layers.{i}.{key}"
            for key in _LAYER_MAP
            if cfg.qkv_bias or not key.endswith(".bias")
        ]
    out: dict[str, list[int]] = {}
    for name in ours:
        tm = tensor_map(name, cfg, names)
        out.update(zip(tm.hf, hf_shapes(cfg, tm), strict=True))
    return out


def _qkv_rows(cfg: LLMConfig, groups: range) -> Iterator[tuple[int, tuple[int, int]]]:
    """(which of q/k/v, its row range) for each KV group in ``groups``, megatron's order."""
    hd = cfg.head_dim
    per_group = cfg.num_attention_heads // cfg.num_query_groups
    for g in groups:
        yield 0, (g * per_group * hd, (g + 1) * per_group * hd)
        yield 1, (g * hd, (g + 1) * hd)
        yield 2, (g * hd, (g + 1) * hd)


def read_shard(
    reader, tm: TensorMap, cfg: LLMConfig, local_shape: list[int], *, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's shard of one megatron parameter, read slice by slice from HF tensors."""
    shapes = hf_shapes(cfg, tm)
    if tm.kind == "copy":
        return reader.read(tm.hf[0], expect=shapes[0])
    if tm.kind == "cols":
        n = local_shape[1]
        return reader.read(tm.hf[0], expect=shapes[0], cols=(tp_rank * n, (tp_rank + 1) * n))
    if tm.kind == "rows":
        n = local_shape[0]
        start, stop = tp_rank * n, min((tp_rank + 1) * n, cfg.vocab_size)
        part = reader.read(tm.hf[0], expect=shapes[0], rows=(start, stop))
        pad = part.new_zeros(n - part.shape[0], *part.shape[1:])
        return torch.cat([part, pad])
    if tm.kind == "gate_up":
        n = local_shape[0] // 2
        rows = (tp_rank * n, (tp_rank + 1) * n)
        return torch.cat(
            [reader.read(hf, expect=s, rows=rows) for hf, s in zip(tm.hf, shapes, strict=True)]
        )
    per_rank = cfg.num_query_groups // tp_size
    groups = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    return torch.cat(
        [reader.read(tm.hf[i], expect=shapes[i], rows=rows) for i, rows in _qkv_rows(cfg, groups)]
    )


def split_full(tm: TensorMap, cfg: LLMConfig, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse at TP 1: HF tensors from one full (unsharded) megatron parameter."""
    if tm.kind in ("copy", "cols"):
        return {tm.hf[0]: full}
    if tm.kind == "rows":
        return {tm.hf[0]: full[: cfg.vocab_size]}
    if tm.kind == "gate_up":
        gate, up = full.chunk(2)
        return dict(zip(tm.hf, (gate, up), strict=True))
    parts: list[list[torch.Tensor]] = [[], [], []]
    offset = 0
    for i, (a, b) in _qkv_rows(cfg, range(cfg.num_query_groups)):
        parts[i].append(full[offset : offset + b - a])
        offset += b - a
    return {hf: torch.cat(p) for hf, p in zip(tm.hf, parts, strict=True)}


@torch.no_grad()
def load_llm_chunk(
    chunk: nn.Module,
    cfg: LLMConfig,
    *,
    tp_rank: int,
    tp_size: int,
    names: HFNames | None = None,
    reader=None,
) -> None:
    """Overwrite every parameter of one GPTModel chunk with the HF model's weights (``cfg.hf``;
    ``names``: where its tensors sit, found from the checkpoint's keys by default)."""
    from omni_trainer.interop.safetensors_io import SafetensorsReader
    from omni_trainer.interop.source import local_dir
    from omni_trainer.models.init import global_llm_names

    if cfg.num_query_groups % tp_size:
        raise HFModelError(
            f"{cfg.hf}: {cfg.num_query_groups} KV heads cannot be split over tensor parallel "
            f"size {tp_size} (parallelism.tensor must divide num_key_value_heads)"
        )
    reader = reader or SafetensorsReader(local_dir(cfg.hf))
    names = names or hf_names_of(reader)
    for name, param in global_llm_names(chunk).items():
        tm = tensor_map(name, cfg, names)
        shard = read_shard(reader, tm, cfg, list(param.shape), tp_rank=tp_rank, tp_size=tp_size)
        if list(shard.shape) != list(param.shape):
            raise HFModelError(
                f"{name} from {', '.join(tm.hf)}: shard shape {list(shard.shape)} does not match "
                f"the model's {list(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))
