"""Context parallelism with adaptive sample sharding (the paper's technique 9, CP half).

Each context-parallel (CP) rank holds an arbitrary set of a micro-batch's tokens: short samples
whole, long ones as zig-zag chunks (``balance.cp.plan_context_parallel``), packed into a local
sequence of ``micro_batch_size x seq_length / cp`` tokens (symmetric: every rank the same size).
Everything in the LLM except attention is per token, so only two things change:

- core attention (:class:`ContextParallelAttention`, swapped into the layer spec) all-gathers
  keys and values over the CP group (backward: the gradients are summed back to their owners)
  and attends for the local queries to the keys the plan allows: same sample, key position <=
  query position. On a GPU, per run of consecutive positions of one sample, causal attention
  aligned to the lower right (``causal_lower_right``: the run's queries against that sample's
  keys up to its last position), which SDPA serves with its flash / memory-efficient kernels,
  no mask; on the CPU, blocks of queries against a boolean mask built from per-token metadata
  (memory bounded by the block). Both compute the same attention. TE's own CP attention needs
  every sample zig-zag split over all CP ranks, which this sharding is not;
- RoPE (:class:`PositionalRotary`) rotates every token by its position in the unsharded row,
  so the attention scores are exactly those of the unsharded model.

megatron-core is used as released and built with ``context_parallel_size = 1`` in its config
(its own CP attention and RoPE slicing assume one zig-zag row, which this sharding does not
follow); megatron's CP process group (``pg_collection.cp``) is the group attention gathers over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from omni_trainer.balance.cp import CPPlan, plan_context_parallel
from omni_trainer.distributed import comm
from omni_trainer.models.batch import DeviceBatch, MediaBatch
from omni_trainer.models.packed import BoundaryAttention


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums every rank's gradient of the gathered
    tensor and returns this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return torch.cat(comm.all_gather(x, group=group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.reduce_scatter(grad, group=ctx.group), None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim 0 (autograd-aware)."""
    return _GatherTokens.apply(x, group)


QUERY_CHUNK = 1024
"""Local queries attended at once: memory is bounded by one chunk's queries x the keys of the
samples they belong to, never the whole ``local x gathered`` score matrix."""


@dataclass
class ContextBoundaries(PackedSeqParams):
    """Which gathered keys each local query may see, as per-token metadata (no dense mask):
    same sample (``seg``, unique negative ids for padding and filler, which see only
    themselves) and key position <= query position (``pos``, the position in the unsharded
    row). ``chunks``: per block of local queries, the indices of the gathered keys of its
    samples, computed on the host once per micro-batch. ``qkv_format='sbhd'`` keeps megatron
    from treating the batch as THD (RoPE here is :class:`PositionalRotary`'s)."""

    q_seg: torch.Tensor | None = None  # [n] local queries
    q_pos: torch.Tensor | None = None
    k_seg: torch.Tensor | None = None  # [cp * n] gathered keys, ranks in order
    k_pos: torch.Tensor | None = None
    chunks: tuple[tuple[int, int, torch.Tensor], ...] = ()
    runs: tuple[tuple[int, int, torch.Tensor], ...] = ()
    """Per run of at most :data:`QUERY_CHUNK` local queries of one sample at consecutive
    positions: the gathered keys of that sample up to the run's last position, by position."""
    filler: torch.Tensor | None = None
    """Local positions of filler tokens (each attends only to itself: its output is its value)."""


def _attend_chunk(q, k_all, v_all, key_idx, q_seg, q_pos, k_seg, k_pos, scale: float):
    """One block of queries ([heads, c, dim]) against the keys of its samples."""
    k = k_all.index_select(0, key_idx).transpose(0, 1)
    v = v_all.index_select(0, key_idx).transpose(0, 1)
    seg, pos = k_seg.index_select(0, key_idx), k_pos.index_select(0, key_idx)
    allowed = (q_seg[:, None] == seg[None]) & (pos[None] <= q_pos[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)


def _attend_run(q, k_all, v_all, key_idx, scale: float):
    """One run of queries ([heads, c, dim]) at consecutive positions of one sample against that
    sample's keys up to the run's last position (``key_idx``, by position): causal, aligned to
    the lower right, so no mask is materialised on a GPU."""
    k = k_all.index_select(0, key_idx).transpose(0, 1)
    v = v_all.index_select(0, key_idx).transpose(0, 1)
    if q.is_cuda and k.shape[0] != q.shape[0]:  # enable_gqa would leave only flash or math
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
    mask = causal_lower_right(q.shape[1], k.shape[1])
    q, k, v = q[None], k[None], v[None]  # [1, heads, n, dim]: the fused kernels want 4-D
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out[0]


def attend_by_runs(
    q: torch.Tensor,
    key_all: torch.Tensor,
    value_all: torch.Tensor,
    boundaries: ContextBoundaries,
    *,
    local_values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Local queries ([heads, n, dim]) over the gathered keys and values ([cp * n, kv heads,
    dim]) run by run (:attr:`ContextBoundaries.runs`); filler rows take their own value
    (``local_values`` [n, kv heads, dim]). Returns [heads, n, dim]."""
    heads, n, dim = q.shape
    out = q.new_zeros(heads, n, dim)
    for start, stop, key_idx in boundaries.runs:
        out[:, start:stop] = _attend_run(q[:, start:stop], key_all, value_all, key_idx, scale)
    if boundaries.filler is not None and boundaries.filler.numel():
        own = local_values.index_select(0, boundaries.filler).transpose(0, 1)
        own = own.repeat_interleave(heads // own.shape[0], dim=0)
        out[:, boundaries.filler] = own.to(out.dtype)
    return out


class ContextParallelAttention(BoundaryAttention):
    """Core attention over a CP group: local queries, every rank's keys and values.

    The boundaries come as :class:`ContextBoundaries` (``packed_seq_params``), see
    :func:`shard_for_context`; queries are attended in blocks of :data:`QUERY_CHUNK`, each
    recomputed in the backward (its scores are never kept), so memory stays bounded.
    """

    def __init__(self, config, layer_number: int, *args, **kwargs):
        from megatron.core.process_groups_config import ProcessGroupCollection

        super().__init__(config, layer_number, *args, **kwargs)
        if self.pg_collection is None:
            self.pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"]
            )
        self.cp_group = self.pg_collection.cp

    def attend(self, query, key, value, boundaries: PackedSeqParams | None) -> torch.Tensor:
        p = boundaries
        if not isinstance(p, ContextBoundaries):
            raise ValueError("ContextParallelAttention needs ContextBoundaries (packed_seq_params)")
        n, b, heads, dim = query.shape
        if b != 1:
            raise ValueError(f"context parallel batches are one packed row, got {b} rows")
        kv = gather_tokens(torch.cat([key[:, 0], value[:, 0]], dim=-1), self.cp_group)
        key_all, value_all = kv.split([key.shape[3], value.shape[3]], dim=-1)
        q = query[:, 0].transpose(0, 1)  # [heads, n, dim]
        if q.is_cuda:
            out = attend_by_runs(
                q, key_all, value_all, p, local_values=value[:, 0], scale=self.softmax_scale
            )
            return out.transpose(0, 1).reshape(n, 1, heads * dim)
        outs = []
        for start, stop, key_idx in p.chunks:
            args = (q[:, start:stop], key_all, value_all, key_idx)
            args += (p.q_seg[start:stop], p.q_pos[start:stop], p.k_seg, p.k_pos)
            if torch.is_grad_enabled():
                out = checkpoint(_attend_chunk, *args, self.softmax_scale, use_reentrant=False)
            else:
                out = _attend_chunk(*args, self.softmax_scale)
            outs.append(out)
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(n, 1, heads * dim)


class PositionalRotary(nn.Module):
    """megatron's RoPE table indexed by given per-token positions ([s, b, 1, dim])."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.positions: torch.Tensor | None = None  # [b, s], set before each forward

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, *_args, **_kwargs) -> torch.Tensor:
        if self.positions is None:
            raise RuntimeError("PositionalRotary: set_rope_positions() before the forward")
        table = self.inner.get_emb(int(self.positions.max()) + 1)  # [n, 1, 1, dim]
        return table[:, 0, 0, :][self.positions.t()].unsqueeze(2)


def use_positional_rope(model: nn.Module) -> None:
    """Replace a GPTModel's RoPE by :class:`PositionalRotary` (no parameters change)."""
    model.rotary_pos_emb = PositionalRotary(model.rotary_pos_emb)


def set_rope_positions(model: nn.Module, positions: torch.Tensor) -> None:
    """Positions ([b, s]) the next forward of ``model`` rotates by; a no-op without CP."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if isinstance(rotary, PositionalRotary):
        rotary.positions = positions


def _samples(segment_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(row, offset, length) of every packed sample of a micro-batch, in row order."""
    out = []
    for row, ids in enumerate(segment_ids):
        for j in range(int(ids.max(initial=-1)) + 1):
            cols = np.flatnonzero(ids == j)
            out.append((row, int(cols[0]), len(cols)))
    return out


def context_token_index(segment_ids: np.ndarray, cp: int) -> tuple[np.ndarray, CPPlan]:
    """Per CP rank, the tokens it holds as row-major indices into the ``[b, s]`` micro-batch.

    Returns ``index`` [cp, b * s / cp] (-1: filler that attends only to itself) and the plan.
    """
    b, s = segment_ids.shape
    capacity = b * s // cp
    samples = _samples(segment_ids)
    plan = plan_context_parallel([n for *_, n in samples], cp=cp, capacity=capacity)
    index = np.full((cp, capacity), -1, dtype=np.int64)
    for r, ranges in enumerate(plan.ranges):
        mine = [
            np.arange(samples[i][0] * s + samples[i][1] + a, samples[i][0] * s + samples[i][1] + z)
            for i, a, z in ranges
        ]
        flat = np.concatenate(mine) if mine else np.zeros(0, dtype=np.int64)
        index[r, : len(flat)] = flat
    return index, plan


def _query_runs(
    seg: np.ndarray, pos: np.ndarray, cp_rank: int
) -> tuple[list[tuple[int, int, np.ndarray]], np.ndarray]:
    """This rank's runs of queries (one sample, consecutive positions, at most
    :data:`QUERY_CHUNK` long) with the gathered keys each sees (same sample, position up to the
    run's last, by position), and its filler positions (negative ``seg``)."""
    q_seg, q_pos = seg[cp_rank], pos[cp_rank]
    k_seg, k_pos = seg.reshape(-1), pos.reshape(-1)
    filler = np.flatnonzero(q_seg < 0)
    breaks = np.flatnonzero((np.diff(q_seg) != 0) | (np.diff(q_pos) != 1)) + 1
    runs = []
    for a, z in zip(np.r_[0, breaks], np.r_[breaks, len(q_seg)], strict=True):
        if q_seg[a] < 0:
            continue
        same = np.flatnonzero(k_seg == q_seg[a])
        same = same[np.argsort(k_pos[same], kind="stable")]
        for start in range(a, z, QUERY_CHUNK):
            stop = min(start + QUERY_CHUNK, z)
            seen = np.searchsorted(k_pos[same], q_pos[stop - 1], side="right")
            runs.append((int(start), int(stop), same[:seen]))
    return runs, filler


def shard_for_context(
    batch: DeviceBatch, segment_ids: np.ndarray, *, cp: int, cp_rank: int
) -> DeviceBatch:
    """This CP rank's share of a full micro-batch: one packed row of ``b * s / cp`` tokens.

    Args:
        batch: the whole micro-batch on the device (``to_device_batch``).
        segment_ids: its ``[b, s]`` sample index per row (-1: padding), from the collated batch.
        cp: context-parallel size; ``cp_rank``: this rank in the CP group.

    Returns:
        tokens, labels, loss mask: gathered for this rank's positions (filler: 0);
        ``position_ids``: each token's position in its unsharded row (RoPE uses them);
        ``packed_seq_params``: :class:`ContextBoundaries` over the gathered sequence (every
        rank's tokens in rank order); media positions remapped, ``rows`` selecting the encoder
        outputs of the positions held here.
    """
    b, s = segment_ids.shape
    device = batch.tokens.device
    index, _ = context_token_index(segment_ids, cp)
    capacity = index.shape[1]
    seg_full = np.where(segment_ids >= 0, np.arange(b)[:, None] * (s + 1) + segment_ids, -1)
    real = index >= 0
    seg = np.where(real, seg_full.reshape(-1)[np.maximum(index, 0)], -1)
    seg = np.where(seg >= 0, seg, -1 - np.arange(seg.size).reshape(seg.shape))  # self only
    pos = np.where(real, index % s, 0)
    k_seg = seg.reshape(-1)
    chunks = []
    for start in range(0, capacity, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, capacity)
        keys = np.flatnonzero(np.isin(k_seg, seg[cp_rank, start:stop]))
        chunks.append((start, stop, torch.as_tensor(keys, device=device)))

    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, device=device)

    runs, filler = _query_runs(seg, pos, cp_rank)
    boundaries = ContextBoundaries(
        qkv_format="sbhd",
        max_seqlen_q=capacity,
        max_seqlen_kv=cp * capacity,
        q_seg=on_device(seg[cp_rank]),
        q_pos=on_device(pos[cp_rank]),
        k_seg=on_device(k_seg),
        k_pos=on_device(pos.reshape(-1)),
        chunks=tuple(chunks),
        runs=tuple((a, z, on_device(keys)) for a, z, keys in runs),
        filler=on_device(filler),
    )
    take = on_device(index[cp_rank].clip(min=0))
    keep = on_device(real[cp_rank])

    def local(t: torch.Tensor) -> torch.Tensor:
        v = t.reshape(-1)[take]
        return torch.where(keep, v, torch.zeros_like(v)).reshape(1, capacity)

    # where each full row-major position sits in this rank's packed row (-1: elsewhere)
    local_flat = np.full(b * s, -1, dtype=np.int64)
    local_flat[index[cp_rank][real[cp_rank]]] = np.flatnonzero(real[cp_rank])
    media = {}
    for modality, m in batch.media.items():
        where = local_flat[m.flat_positions.cpu().numpy()]
        rows = np.flatnonzero(where >= 0)
        media[modality] = MediaBatch(
            arrays=m.arrays, flat_positions=on_device(where[rows]), rows=on_device(rows)
        )
    return DeviceBatch(
        tokens=local(batch.tokens),
        labels=local(batch.labels),
        loss_mask=local(batch.loss_mask),
        position_ids=on_device(pos[cp_rank].reshape(1, capacity)),
        packed_seq_params=boundaries,
        media=media,
    )
