"""The LLM's packed attention on the GPU path: one varlen kernel launch, causal, with megatron's
softmax scale and grouped-query heads, equal to the per-sample SDPA the CPU runs (fakes stand in
for the CUDA kernels and compute attention the plain way)."""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omni_trainer.models import packed
from omni_trainer.models.encoders import layers

LENGTHS = [5, 3, 8]


def per_sample_causal(q, k, v, cu, *, scale=None):
    """Plain causal attention of each sample ([t, heads, dim]; k, v with as many heads as q)."""
    bounds = torch.as_tensor(cu).tolist()
    outs = []
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
    return torch.cat([o.transpose(0, 1) for o in outs])


@pytest.fixture
def qkv():
    gen = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q = torch.randn(t, 4, 8, generator=gen)
    k, v = (torch.randn(t, 2, 8, generator=gen) for _ in range(2))  # grouped-query: 2 kv heads
    return q, k, v


def attention(scale_layers: bool = True) -> packed.PackedAttention:
    config = types.SimpleNamespace(
        attention_dropout=0.0, kv_channels=8, apply_query_key_layer_scaling=scale_layers
    )
    return packed.PackedAttention(config, 3, None, "self")  # layer 3: scale / 3


def test_the_llm_uses_one_causal_varlen_launch_where_a_kernel_serves(qkv, monkeypatch) -> None:
    q, k, v = qkv
    boundaries = packed.pack_boundaries(np.repeat(np.arange(3), LENGTHS)[None], torch.device("cpu"))
    core = attention()
    expected = core(q, k, v, None, packed_seq_params=boundaries)  # CPU: SDPA per sample
    calls = []

    def kernel(q, k, v, cu, longest, *, causal=False, scale=None):
        calls.append((cu.tolist(), longest, causal, scale))
        rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        return per_sample_causal(q, k, v, cu, scale=scale)

    monkeypatch.setattr(packed, "gpu_varlen_kernel", lambda: kernel)
    monkeypatch.setattr(packed, "kernel_serves", lambda q: True)
    got = core(q, k, v, None, packed_seq_params=boundaries)
    assert calls == [([0, 5, 8, 16], 8, True, pytest.approx(8**-0.5 / 3))]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", ["2.9: is_causal", "2.13: window_size, scale, enable_gqa"])
def test_torch_varlen_wrapper_fills_in_what_its_torch_lacks(qkv, style, monkeypatch) -> None:
    """torch 2.9's varlen_attn has no scale and no grouped-query heads: the wrapper pre-scales
    the query and repeats the kv heads; 2.13's takes them as keywords. Both give one answer."""
    from torch.nn.attention import varlen

    q, k, v = qkv
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)

    def old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        assert k.shape[1] == q.shape[1] and is_causal
        return per_sample_causal(q, k, v, cu_q)

    def new(
        q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        assert window_size == (-1, 0) and enable_gqa
        rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        return per_sample_causal(q, k, v, cu_q, scale=scale)

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(varlen, "varlen_attn", old if style.startswith("2.9") else new)
    kernel = layers._torch_kernel()
    got = kernel(q, k, v, cu, 8, causal=True, scale=0.2)
    rep = (t.repeat_interleave(2, dim=1) for t in (k, v))
    torch.testing.assert_close(got, per_sample_causal(q, *rep, cu, scale=0.2), rtol=1e-5, atol=1e-6)
