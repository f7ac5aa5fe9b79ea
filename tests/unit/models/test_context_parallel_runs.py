"""Context-parallel attention by runs (the GPU path: per run of one sample, causal aligned to
the lower right, no mask) equals the masked blocks (the CPU path) and the unsharded model's
per-sample causal attention, outputs and gradients, on every CP rank (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omni_trainer.models import context_parallel as cpm
from omni_trainer.models.batch import DeviceBatch

HEADS, KV_HEADS, DIM = 4, 2, 8


def _shards(segment_ids: np.ndarray, cp: int) -> list[cpm.ContextBoundaries]:
    b, s = segment_ids.shape
    zeros = torch.zeros(1, b * s, dtype=torch.long)
    batch = DeviceBatch(zeros, zeros, zeros.float(), zeros, None, {})
    return [
        cpm.shard_for_context(batch, segment_ids, cp=cp, cp_rank=r).packed_seq_params
        for r in range(cp)
    ]


def _masked_blocks(q, k_all, v_all, p: cpm.ContextBoundaries, scale: float) -> torch.Tensor:
    outs = [
        cpm._attend_chunk(q[:, a:z], k_all, v_all, idx, p.q_seg[a:z], p.q_pos[a:z], p.k_seg,
                          p.k_pos, scale)
        for a, z, idx in p.chunks
    ]  # fmt: skip
    return torch.cat(outs, dim=1)


def _unsharded(q_rows, k_rows, v_rows, segment_ids: np.ndarray, scale: float) -> torch.Tensor:
    """[heads, b * s, dim]: causal attention within each sample (padding: itself only)."""
    out = torch.zeros(HEADS, q_rows.shape[0], DIM, dtype=q_rows.dtype)
    flat = segment_ids.reshape(-1)
    s = segment_ids.shape[1]
    for row in range(segment_ids.shape[0]):
        for j in set(segment_ids[row].tolist()) - {-1}:
            idx = torch.as_tensor(row * s + np.flatnonzero(segment_ids[row] == j))
            q, k, v = (t.index_select(0, idx).transpose(0, 1) for t in (q_rows, k_rows, v_rows))
            out[:, idx] = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
    pad = torch.as_tensor(np.flatnonzero(flat < 0))
    out[:, pad] = (
        v_rows.index_select(0, pad).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    )
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_runs_equal_masked_blocks_and_the_unsharded_attention(cp: int, monkeypatch) -> None:
    monkeypatch.setattr(cpm, "QUERY_CHUNK", 16)  # several blocks and runs per sample
    # two rows of 96: a long sample (split zig-zag), short whole ones, padding
    segment_ids = np.array([[0] * 70 + [1] * 20 + [-1] * 6, [0] * 9 + [1] * 80 + [2] * 7])
    b, s = segment_ids.shape
    gen = torch.Generator().manual_seed(0)
    q_rows = torch.randn(b * s, HEADS, DIM, generator=gen, dtype=torch.float64)
    k_rows, v_rows = (torch.randn(b * s, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
                      for _ in range(2))  # fmt: skip
    scale = DIM**-0.5
    expected = _unsharded(q_rows, k_rows, v_rows, segment_ids, scale)
    index, _ = cpm.context_token_index(segment_ids, cp)
    take = torch.as_tensor(np.maximum(index, 0))
    real = torch.as_tensor(index >= 0)

    def local(t: torch.Tensor) -> torch.Tensor:  # [cp, n, heads, dim], filler zeros
        return torch.where(real[..., None, None], t[take], torch.zeros(()).to(t))

    k_loc, v_loc = local(k_rows), local(v_rows)
    k_all, v_all = k_loc.flatten(0, 1), v_loc.flatten(0, 1)
    for r, p in enumerate(_shards(segment_ids, cp)):
        assert p.runs and all(len(keys) for *_, keys in p.runs)
        q = local(q_rows)[r].transpose(0, 1).clone().requires_grad_(True)
        ka, va = k_all.clone().requires_grad_(True), v_all.clone().requires_grad_(True)
        runs = cpm.attend_by_runs(q, ka, va, p, local_values=va.view(cp, -1, KV_HEADS, DIM)[r],
                                  scale=scale)  # fmt: skip
        grads_runs = torch.autograd.grad(runs.square().sum(), (q, ka, va))
        blocks = _masked_blocks(q, ka, va, p, scale)
        grads_blocks = torch.autograd.grad(blocks.square().sum(), (q, ka, va))
        torch.testing.assert_close(runs, blocks, rtol=1e-12, atol=1e-12)
        for a, b_ in zip(grads_runs, grads_blocks, strict=True):
            torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)
        mine = real[r]
        torch.testing.assert_close(
            runs[:, mine], expected[:, take[r][mine]], rtol=1e-12, atol=1e-12
        )
