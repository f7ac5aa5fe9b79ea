"""Context parallelism with adaptive sample sharding (PAPER.md technique 9, the CP half).

Each context-parallel (CP) rank holds an arbitrary set of a micro-batch's tokens: short samples
whole, long ones as zig-zag chunks (``balance.cp.plan_context_parallel``), packed into a local
sequence of ``micro_batch_size x seq_length / cp`` tokens (symmetric: every rank the same size).
Everything in the LLM except attention is per token, so only two things change:

- core attention (:class:`ContextParallelAttention`, swapped into the layer spec) all-gathers
  keys and values over the CP group (backward: the gradients are summed back to their owners)
  and attends for the local queries under a mask built from the plan: same sample, key position
  <= query position;
- RoPE (:class:`PositionalRotary`) rotates every token by its position in the unsharded row,
  so the attention scores are exactly those of the unsharded model.

megatron-core is used as released and built with ``context_parallel_size = 1`` in its config
(its own CP attention and RoPE slicing assume one zig-zag row, which this sharding does not
follow); megatron's CP process group (``pg_collection.cp``) is the group attention gathers over.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omni_trainer.balance.cp import CPPlan, plan_context_parallel
from omni_trainer.distributed import comm
from omni_trainer.models.batch import DeviceBatch, MediaBatch


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


class ContextParallelAttention(nn.Module):
    """Core attention over a CP group: local queries, every rank's keys and values.

    Built by megatron's ``SelfAttention`` in place of ``DotProductAttention`` (same arguments);
    the arithmetic is megatron's own ``DotProductAttention`` over the flattened token set.
    ``attention_mask`` is the plan's ``[1, 1, local, cp * local]`` mask (True = masked), see
    :func:`shard_for_context`.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, **kwargs):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        super().__init__()
        pg_collection = kwargs.get("pg_collection")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        self.inner = DotProductAttention(
            config, layer_number, attn_mask_type, attention_type, **kwargs
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        s, b, heads, dim = query.shape

        def tokens(t: torch.Tensor) -> torch.Tensor:  # [s, b, n, d] -> [b * s, 1, n, d]
            return t.transpose(0, 1).reshape(b * s, 1, t.shape[2], t.shape[3])

        kv = gather_tokens(torch.cat([tokens(key), tokens(value)], dim=-1), self.cp_group)
        key_all, value_all = kv.split([key.shape[3], value.shape[3]], dim=-1)
        out = self.inner(
            tokens(query),
            key_all,
            value_all,
            attention_mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )  # [b * s, 1, heads * dim]
        return out.reshape(b, s, heads * dim).transpose(0, 1).contiguous()


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


def context_parallel_spec(spec):
    """A copy of a GPT layer spec whose core attention is :class:`ContextParallelAttention`."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


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


def shard_for_context(
    batch: DeviceBatch, segment_ids: np.ndarray, *, cp: int, cp_rank: int
) -> DeviceBatch:
    """This CP rank's share of a full micro-batch, in megatron's shapes with ``s / cp``.

    Args:
        batch: the whole micro-batch on the device (``to_device_batch``).
        segment_ids: its ``[b, s]`` sample index per row (-1: padding), from the collated batch.
        cp: context-parallel size; ``cp_rank``: this rank in the CP group.

    Returns:
        tokens, labels, loss mask: gathered for this rank's positions (filler: 0);
        ``position_ids``: each token's position in its unsharded row (RoPE uses them);
        ``attention_mask``: ``[1, 1, n, cp * n]``, True where a local query may NOT see a key of
        the gathered sequence (every rank's tokens in rank order); media positions remapped,
        ``rows`` selecting the encoder outputs of the positions held here.
    """
    b, s = segment_ids.shape
    device = batch.tokens.device
    index, _ = context_token_index(segment_ids, cp)
    capacity = index.shape[1]
    seg_full = np.where(segment_ids >= 0, np.arange(b)[:, None] * (s + 1) + segment_ids, -1)
    seg_full = seg_full.reshape(-1)
    real = index >= 0
    seg = np.where(real, seg_full[np.maximum(index, 0)], -1)
    pos = np.where(real, index % s, 0)
    q_seg, q_pos = seg[cp_rank], pos[cp_rank]
    k_seg, k_pos = seg.reshape(-1), pos.reshape(-1)
    allowed = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] >= 0)
    allowed &= k_pos[None, :] <= q_pos[:, None]
    allowed[np.arange(capacity), cp_rank * capacity + np.arange(capacity)] = True
    mask = torch.as_tensor(~allowed, device=device)[None, None]

    mine = torch.as_tensor(index[cp_rank], device=device)
    take = mine.clamp(min=0)
    keep = torch.as_tensor(real[cp_rank], device=device)

    def local(t: torch.Tensor) -> torch.Tensor:
        v = t.reshape(-1)[take]
        return torch.where(keep, v, torch.zeros_like(v)).reshape(b, s // cp)

    # where each full row-major position sits in megatron's local [s / cp, b] flattening
    t = np.arange(capacity)
    local_flat = np.full(b * s, -1, dtype=np.int64)
    local_flat[index[cp_rank][real[cp_rank]]] = ((t % (s // cp)) * b + t // (s // cp))[
        real[cp_rank]
    ]
    media = {}
    for modality, m in batch.media.items():
        f = m.flat_positions.cpu().numpy()  # [s, b] flattening of the full batch
        where = local_flat[(f % b) * s + f // b]
        rows = np.flatnonzero(where >= 0)
        media[modality] = MediaBatch(
            arrays=m.arrays,
            flat_positions=torch.as_tensor(where[rows], device=device),
            rows=torch.as_tensor(rows, device=device),
        )
    return DeviceBatch(
        tokens=local(batch.tokens),
        labels=local(batch.labels),
        loss_mask=local(batch.loss_mask),
        position_ids=torch.as_tensor(pos[cp_rank].reshape(b, s // cp), device=device),
        attention_mask=mask,
        media=media,
    )
