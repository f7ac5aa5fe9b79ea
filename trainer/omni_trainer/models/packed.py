"""Packed samples as boundaries: megatron's ``PackedSeqParams`` (THD) and a core attention that
honours them without a dense mask.

A collated micro-batch ``[b, s]`` reaches the LLM as one packed row ``[1, b * s]`` whose samples
(and each row's trailing padding run) are delimited by ``cu_seqlens``. megatron passes the
boundaries down to core attention and to RoPE (which then restarts positions in every sample):
TE's ``DotProductAttention`` (GPU) runs flash / cuDNN varlen kernels on them; on the local spec
:class:`PackedAttention` takes their place through the layer spec (megatron's own way of
swapping kernels): one causal varlen kernel launch for the pack on a GPU (flash-attn's or
PyTorch's, ``encoders.layers.gpu_varlen_kernel``), causal SDPA per sample on the CPU. Read
against megatron-core 0.16.1 (``transformer/attention.py`` squeezes the batch dimension for
``qkv_format='thd'``; ``models/common/embeddings/rope_utils.py`` applies RoPE per ``cu_seqlens``
segment).

Why per-sample SDPA rather than ``flex_attention`` with a document mask on CPU (measured with
``bench/attention.py``): torch 2.13's flex attention has no backward on CPU, so it cannot train
there; its forward also needs ``torch.compile`` (~30 s, again whenever the sample layout changes,
i.e. every micro-batch; uncompiled it is ~5x to 100x slower). Per-sample SDPA matches the dense
mask's results without its ``[s, s]`` mask and never computes scores across samples.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import nn

from omni_trainer.models.encoders.layers import gpu_varlen_kernel, kernel_serves


@dataclass
class PackedSamples(PackedSeqParams):
    """megatron's THD boundaries plus their host copy (``seqlens``), so a CPU kernel can split
    the packed row without reading ``cu_seqlens`` back from the device in every layer."""

    seqlens: tuple[int, ...] = ()


def sample_lengths(segment_ids: np.ndarray) -> list[int]:
    """Lengths of the runs of equal segment id along each row, rows concatenated: every packed
    sample, and each row's padding (``-1``) run as one more segment attending only to itself."""
    lengths: list[int] = []
    for row in np.asarray(segment_ids):
        starts = np.flatnonzero(np.diff(row, prepend=row[0] - 1))
        lengths.extend(np.diff(np.append(starts, len(row))).tolist())
    return lengths


def pack_boundaries(segment_ids: np.ndarray, device: torch.device) -> PackedSamples:
    """The THD boundaries of a collated ``[b, s]`` micro-batch flattened to one row, computed on
    the host from metadata (no device sync) and moved to ``device`` (int32, as TE wants)."""
    lengths = sample_lengths(segment_ids)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    cu = cu.to(device, non_blocking=True)
    longest = max(lengths)
    return PackedSamples(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        seqlens=tuple(lengths),
    )


class BoundaryAttention(nn.Module):
    """A core attention megatron's ``SelfAttention`` builds in place of ``DotProductAttention``
    (same arguments, megatron-core 0.16.1) that separates samples by boundaries passed as
    ``packed_seq_params``; a dense ``attention_mask`` is refused. Softmax scale as megatron's
    (1/sqrt(head dim), query-key layer scaling if configured); no attention dropout."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        pg_collection=None,
        **_unused,
    ) -> None:
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("this core attention has no attention dropout (the trainer uses 0)")
        scale = 1.0 / config.kv_channels**0.5 if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            scale /= max(1, layer_number)
        self.softmax_scale = scale
        self.pg_collection = pg_collection

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                f"{type(self).__name__} takes sample boundaries (packed_seq_params), not a mask"
            )
        return self.attend(query, key, value, packed_seq_params)

    def attend(self, query, key, value, boundaries: PackedSeqParams | None) -> torch.Tensor:
        raise NotImplementedError


class PackedAttention(BoundaryAttention):
    """Causal core attention for the local spec that respects sample boundaries: with
    :class:`PackedSamples` (``thd``: ``[t, heads, dim]``) each sample attends causally to itself
    only (SDPA per sample); without boundaries (``sbhd``: generation) each row is one causal
    sequence."""

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[..., heads, n, dim] causal attention. Grouped-query heads: broadcast by SDPA on the
        CPU; repeated on a GPU, where ``enable_gqa`` would leave only the flash kernel (bf16)
        and the math kernel (an [n, n] score matrix per head) to an fp32 run."""
        if q.is_cuda and k.shape[-3] != q.shape[-3]:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[-3] != q.shape[-3]
        )

    def attend(self, query, key, value, boundaries: PackedSeqParams | None) -> torch.Tensor:
        if boundaries is None:  # [s, b, n, d]: every row one causal sequence
            s, b = query.shape[:2]
            out = self._causal(*(t.permute(1, 2, 0, 3) for t in (query, key, value)))
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if not isinstance(boundaries, PackedSamples) or boundaries.qkv_format != "thd":
            raise ValueError("PackedAttention needs PackedSamples boundaries in thd format")
        kernel = gpu_varlen_kernel()
        if kernel is not None and kernel_serves(query):  # one launch for the pack (GPU)
            out = kernel(
                query,
                key,
                value,
                boundaries.cu_seqlens_q,
                boundaries.max_seqlen_q,
                causal=True,
                scale=self.softmax_scale,
            )
            return out.reshape(query.shape[0], -1)
        lengths = list(boundaries.seqlens)
        parts = zip(
            *(t.transpose(0, 1).split(lengths, dim=1) for t in (query, key, value)), strict=True
        )  # per sample: [heads, n, dim]
        out = torch.cat([self._causal(q, k, v) for q, k, v in parts], dim=1)
        return out.transpose(0, 1).reshape(query.shape[0], -1)  # [t, heads * dim]


def with_core_attention(spec, core_attention: type[nn.Module]):
    """A copy of a GPT layer spec whose core attention is ``core_attention``."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec
