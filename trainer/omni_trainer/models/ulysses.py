"""Ulysses sequence parallelism for one long encoder sample (paper technique 2, the "long" half).

The ranks of a sequence-parallel (SP) group each hold a contiguous shard of one sample's tokens
(``lssp.shard_sizes``: as even as possible, first ranks one more). Everything in an encoder block is
per token except what goes through its :class:`~omni_trainer.models.encoders.layers.TokenMixer`, so
:class:`UlyssesMixer` only changes those ops:

- attention: one all-to-all turns ``[n_local, heads, d]`` q, k, v into ``[n_full, heads/sp, d]``,
  the unchanged attention core runs over the whole sample with this rank's heads, and a second
  all-to-all brings ``[n_local, heads, d]`` back (DeepSpeed-Ulysses, Jacobs et al. 2023);
- the Conformer's depthwise convolution: the whole sample is gathered, convolved, and this rank's
  shard kept (activations of width ``hidden`` only, outside attention; cheap next to attention).

Both collectives are differentiable, so the backward pass runs the transposed exchanges and a
rank's parameter gradients are its share: summed over the group (as data-parallel gradient
reduction does anyway) they equal the gradients of encoding the sample on one rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from omni_trainer.balance.lssp import shard_offsets, shard_sizes
from omni_trainer.distributed import comm
from omni_trainer.models.encoders.layers import (
    AttentionFn,
    TokenMixer,
    Varlen,
    varlen_attention,
)


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all_single`` along dim 0 with uneven splits; backward is the reverse exchange.

    (``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated and
    warns on every call site.)
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        input_splits: list[int],
        output_splits: list[int],
        group: dist.ProcessGroup,
    ) -> Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        return comm.all_to_all_single(
            out, x, output_splits=output_splits, input_splits=input_splits, group=group
        )

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        input_splits, output_splits = ctx.splits
        return _AllToAll.apply(grad, output_splits, input_splits, ctx.group), None, None, None


def all_to_all(
    x: Tensor, *, input_splits: list[int], output_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Differentiable all-to-all along dim 0: ``x``'s i-th chunk goes to rank i, chunks received
    from ranks are concatenated in rank order."""
    return _AllToAll.apply(x, input_splits, output_splits, group)


@dataclass(frozen=True)
class _Shard:
    group: dist.ProcessGroup
    sizes: tuple[int, ...]
    rank: int
    full: Varlen
    """The whole sample's boundaries, built once for every layer of the block."""

    @property
    def sp(self) -> int:
        return len(self.sizes)

    @property
    def local(self) -> int:
        return self.sizes[self.rank]


class UlyssesMixer(TokenMixer):
    """A :class:`TokenMixer` that, inside :meth:`sharded`, mixes one sample sharded across ranks.

    Outside :meth:`sharded` it computes locally like the default mixer, so one encoder instance
    encodes short samples data-parallel and long ones sequence-parallel.

    Args:
        core: attention kernel over full samples, run on this rank's heads.
    """

    def __init__(self, core: AttentionFn = varlen_attention) -> None:
        super().__init__(core)
        self._shard: _Shard | None = None

    @property
    def active(self) -> bool:
        """Whether calls now mix a sequence-sharded sample."""
        return self._shard is not None

    @contextmanager
    def sharded(self, group: dist.ProcessGroup, sizes: Sequence[int]) -> Iterator[None]:
        """Within the block, tokens given to the mixer are this rank's shard of ONE sample.

        Args:
            group: the SP group; every rank of it must run the same layers in the block.
            sizes: tokens held by each rank of ``group``, in group-rank order (contiguous shards).
        """
        if self._shard is not None:
            raise RuntimeError("UlyssesMixer.sharded blocks do not nest")
        sp = dist.get_world_size(group)
        if len(sizes) != sp:
            raise ValueError(f"{len(sizes)} shard sizes for a group of {sp} ranks")
        sizes = tuple(int(s) for s in sizes)
        self._shard = _Shard(group, sizes, dist.get_rank(group), Varlen.of([sum(sizes)]))
        try:
            yield
        finally:
            self._shard = None

    def state(self) -> _Shard | None:
        return self._shard

    @contextmanager
    def restored(self, state: _Shard | None) -> Iterator[None]:
        previous, self._shard = self._shard, state
        try:
            yield
        finally:
            self._shard = previous

    def _check_local(self, x: Tensor, shard: _Shard) -> None:
        if x.shape[0] != shard.local:
            raise ValueError(
                f"rank {shard.rank} holds {shard.local} tokens of the sharded sample, "
                f"got {x.shape[0]}"
            )

    def attention(self, q: Tensor, k: Tensor, v: Tensor, seqs: Varlen) -> Tensor:
        """Local, or (sharded) all-to-all to full sequence x local heads, core, and back."""
        shard = self._shard
        if shard is None:
            return super().attention(q, k, v, seqs)
        self._check_local(q, shard)
        n_local, heads, head_dim = q.shape
        if heads % shard.sp:
            raise ValueError(
                f"Ulysses needs the heads ({heads}) divisible by the sequence-parallel size "
                f"({shard.sp})"
            )
        local_heads = heads // shard.sp
        # [n_local, 3, heads, d] -> [sp * n_local, 3, heads/sp, d]: chunk r = rank r's heads.
        qkv = torch.stack((q, k, v), dim=1).view(n_local, 3, shard.sp, local_heads, head_dim)
        qkv = qkv.permute(2, 0, 1, 3, 4).reshape(shard.sp * n_local, 3, local_heads, head_dim)
        full = all_to_all(
            qkv,
            input_splits=[n_local] * shard.sp,
            output_splits=list(shard.sizes),
            group=shard.group,
        )  # [n_full, 3, heads/sp, d], tokens in sequence order
        qf, kf, vf = full.unbind(1)
        out = self.core_attention(qf, kf, vf, shard.full)  # [n_full, heads/sp, d]
        back = all_to_all(
            out,
            input_splits=list(shard.sizes),
            output_splits=[n_local] * shard.sp,
            group=shard.group,
        )  # [sp * n_local, heads/sp, d]: chunk r = rank r's heads of my tokens
        back = back.view(shard.sp, n_local, local_heads, head_dim).permute(1, 0, 2, 3)
        return back.reshape(n_local, heads, head_dim)

    def gather_sequence(self, x: Tensor, seqs: Varlen) -> tuple[Tensor, Varlen]:
        """(Sharded) the whole sample on every rank: an all-to-all sending this shard to all ranks
        (an all-gather of uneven shards without padding; its backward sums every rank's gradient
        for this shard, the reduce-scatter that gloo lacks)."""
        shard = self._shard
        if shard is None:
            return super().gather_sequence(x, seqs)
        self._check_local(x, shard)
        full = all_to_all(
            x.repeat(shard.sp, *([1] * (x.ndim - 1))),
            input_splits=[shard.local] * shard.sp,
            output_splits=list(shard.sizes),
            group=shard.group,
        )
        return full, shard.full

    def scatter_sequence(self, x_full: Tensor) -> Tensor:
        """(Sharded) this rank's contiguous shard of the whole sample."""
        shard = self._shard
        if shard is None:
            return super().scatter_sequence(x_full)
        start = shard_offsets(shard.sizes)[shard.rank]
        return x_full[start : start + shard.local]


class ShardableEncoder(Protocol):
    """What :func:`encode_sequence_parallel` needs: the encoders in ``models/encoders``."""

    mixer: TokenMixer
    drop_prefix: int
    """Leading block outputs of a sample that are not encoder output (CLIP's class token)."""
    merge_unit: int
    """Block tokens per output token (Qwen2.5-VL's merger: 4), merged after the blocks."""

    def embed(self, media: Sequence[Tensor]) -> tuple[Tensor, list[int]]: ...

    def encode_tokens(self, x: Tensor, seqs: Varlen) -> Tensor: ...


def encode_sequence_parallel(
    encoder: ShardableEncoder, sample: Tensor, group: dist.ProcessGroup
) -> Tensor:
    """Encode one long sample with all ranks of ``group``; every rank calls this with the same one.

    The embedding (patch embed / conv subsampling and positions) runs on the whole sample on every
    rank (it is per sample and cheap next to the blocks); each rank keeps its contiguous shard
    (``shard_sizes``) and runs the blocks on it under Ulysses.

    Args:
        encoder: built with a :class:`UlyssesMixer`, identical weights on every rank.
        sample: one image [C, H, W] or clip [frames, n_mels].
        group: the sequence-parallel group.

    Returns:
        This rank's shard of the output, [n_local, hidden]; concatenated in group-rank order the
        shards are the single-rank encoding of the sample. The shards are ``shard_sizes`` of the
        output tokens: the first rank also runs the blocks on the ``drop_prefix`` leading tokens
        the output leaves out, and drops them. An encoder that merges ``merge_unit`` block
        tokens into one output token gets shards of whole merge units.
    """
    mixer = encoder.mixer
    if not isinstance(mixer, UlyssesMixer):
        raise TypeError(
            f"sequence parallelism needs an encoder built with a UlyssesMixer, "
            f"got {type(mixer).__name__}"
        )
    drop, unit = encoder.drop_prefix, encoder.merge_unit
    x, (n,) = encoder.embed([sample])
    sizes = [s * unit for s in shard_sizes((n - drop) // unit, dist.get_world_size(group))]
    sizes[0] += drop
    rank = dist.get_rank(group)
    start = shard_offsets(sizes)[rank]
    x_local = x[start : start + sizes[rank]]
    with mixer.sharded(group, sizes):
        out = encoder.encode_tokens(x_local, Varlen.of([sizes[rank]]))
    return out[drop:] if rank == 0 else out
