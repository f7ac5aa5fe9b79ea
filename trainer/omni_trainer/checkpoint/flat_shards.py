"""Checkpoint entries of a parameter split flat over data-parallel ranks (ZeRO-1), per rank.

The distributed optimizer gives each rank of its group a contiguous range ``[lo, hi)`` of a
parameter's flattened (tensor-parallel-local) elements: its fp32 main weights and Adam moments
exist for that range only. A checkpoint keeps the layout-free format of ``checkpoint/state.py``
(one logical tensor per global name) by declaring each rank's range as DCP chunks of the full
tensor: a flat range of a row-major tensor is a union of at most ``2 x ndim - 1`` boxes (a
partial row, whole rows, a partial row; recursively), and each box is cut again at the
tensor-parallel pieces (stride included) it spans. So every rank writes and reads only its own
range, and a load in any other layout (another data-parallel size, no distributed optimizer, a
checkpoint whose tensors were written whole) reads exactly the overlapping byte ranges.

DCP reads a ``ShardedTensor``'s local chunks and size only; torch still checks that the global
metadata tiles the tensor, pairwise (quadratic: listing every holder's chunks costs 2.6 s per
tensor at dp256). So the metadata lists this rank's chunks exactly and the rest of the tensor in
at most as many boxes again, placed on a peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

MODEL_SLOT = ""  # the key of the weight itself among a parameter's entries


@dataclass(frozen=True)
class FlatShard:
    """This rank's range of a flat-split LLM parameter.

    Attributes:
        lo, hi: the range of the flattened TP-local tensor this rank holds (``lo == hi``: none).
        main: the 1-D fp32 main weights of the range (the optimizer's key; a load writes into
            it), None when the range is empty.
        peer: the global rank of another member of the split at this TP position (this rank's
            own when it is alone), where the metadata places the rest of the tensor.
    """

    lo: int
    hi: int
    main: nn.Parameter | None
    peer: int


def flat_boxes(shape: list[int], lo: int, hi: int) -> list[tuple[list[int], list[int]]]:
    """The boxes ``(offsets, sizes)`` covering elements ``[lo, hi)`` of a row-major tensor of
    ``shape``, in flat order (each box is a contiguous run of that range)."""
    if lo >= hi:
        return []
    if not shape:
        return [([], [])]
    row = math.prod(shape[1:])
    rest = list(shape[1:])
    boxes: list[tuple[list[int], list[int]]] = []

    def within(r: int, a: int, b: int) -> None:
        boxes.extend(([r, *o], [1, *s]) for o, s in flat_boxes(rest, a - r * row, b - r * row))

    start = lo
    if start % row:
        r = start // row
        end = min(hi, (r + 1) * row)
        within(r, start, end)
        start = end
    whole_end = hi // row * row
    if start < whole_end:
        boxes.append(([start // row] + [0] * len(rest), [(whole_end - start) // row, *rest]))
        start = whole_end
    if start < hi:
        within(start // row, start, hi)
    return boxes


@dataclass(frozen=True)
class _Chunk:
    """One DCP chunk of a rank's range: where it sits in the full tensor (``offsets``,
    ``sizes``), and how to view it in the 1-D range:
    ``range[a:b].view(box).narrow(*narrow)``."""

    rank: int
    offsets: list[int]
    sizes: list[int]
    a: int
    b: int
    box: list[int]
    narrow: tuple[int, int, int] | None

    def view(self, values: torch.Tensor) -> torch.Tensor:
        v = values[self.a : self.b].view(self.box)
        return v if self.narrow is None else v.narrow(*self.narrow)

    def meta(self, device: torch.device) -> ShardMetadata:
        return ShardMetadata(self.offsets, self.sizes, f"rank:{self.rank}/{device}")


def _tp_pieces(
    param: nn.Parameter, *, tp_rank: int, tp_size: int
) -> tuple[list[int], int, list[tuple[int, int, int]]]:
    """Full shape, partition dim and ``(global offset, local start, length)`` of each TP piece
    (the layout of ``omni_trainer.models.init.shard_of``; one piece when not TP-sharded)."""
    if not (tp_size > 1 and getattr(param, "tensor_model_parallel", False)):
        return list(param.shape), 0, [(0, 0, param.shape[0] if param.ndim else 1)]
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    full = list(param.shape)
    full[dim] *= tp_size
    piece = full[dim] // (tp_size * stride)
    return full, dim, [((tp_rank + k * tp_size) * piece, k * piece, piece) for k in range(stride)]


def _chunks(
    param: nn.Parameter, lo: int, hi: int, *, rank: int, tp_rank: int, tp_size: int
) -> list[_Chunk]:
    """The chunks of range ``[lo, hi)`` held by global ``rank`` at TP rank ``tp_rank``."""
    _, dim, pieces = _tp_pieces(param, tp_rank=tp_rank, tp_size=tp_size)
    out: list[_Chunk] = []
    for offsets, sizes in flat_boxes(list(param.shape), lo, hi):
        a = sum(o * math.prod(param.shape[d + 1 :]) for d, o in enumerate(offsets)) - lo
        b = a + math.prod(sizes)
        if not offsets:  # a 0-dim parameter
            out.append(_Chunk(rank, [], [], a, b, [], None))
            continue
        for g, start, length in pieces:
            x, y = max(offsets[dim], start), min(offsets[dim] + sizes[dim], start + length)
            if x >= y:
                continue
            at, size = list(offsets), list(sizes)
            at[dim], size[dim] = g + x - start, y - x
            whole = (x, y) == (offsets[dim], offsets[dim] + sizes[dim])
            narrow = None if whole else (dim, x - offsets[dim], y - x)
            out.append(_Chunk(rank, at, size, a, b, sizes, narrow))
    return out


class FlatLayout:
    """The DCP chunks of one flat-split parameter: this rank's (with their views into its
    range) and, for the metadata, the rest of the tensor's."""

    def __init__(
        self, param: nn.Parameter, shard: FlatShard, *, tp_rank: int, tp_size: int
    ) -> None:
        tp_sharded = tp_size > 1 and bool(getattr(param, "tensor_model_parallel", False))
        self.size, _, _ = _tp_pieces(param, tp_rank=tp_rank, tp_size=tp_size)
        me = dist.get_rank() if dist.is_initialized() else 0
        n = param.numel()
        kw = {"tp_rank": tp_rank, "tp_size": tp_size if tp_sharded else 1}
        self.mine = _chunks(param, shard.lo, shard.hi, rank=me, **kw)
        rest = [(0, shard.lo), (shard.hi, n)]
        self.everyone = self.mine + [
            c for lo, hi in rest for c in _chunks(param, lo, hi, rank=shard.peer, **kw)
        ]
        # megatron's rank order (TP fastest): TP rank t's whole shard is on ``me - tp_rank + t``
        for t in range(tp_size) if tp_sharded else []:
            if t != tp_rank:
                whole = _chunks(param, 0, n, rank=me - tp_rank + t, tp_rank=t, tp_size=tp_size)
                self.everyone.extend(whole)

    def _sharded(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> ShardedTensor:
        device = tensors[0].device if tensors else torch.device("cpu")
        props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
        meta = ShardedTensorMetadata(
            shards_metadata=[c.meta(device) for c in self.everyone],
            size=torch.Size(self.size),
            tensor_properties=props,
        )
        shards = [Shard(t, c.meta(device)) for t, c in zip(tensors, self.mine, strict=True)]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, meta, process_group=dist.group.WORLD
        )

    def host_copy(self, values: torch.Tensor) -> ShardedTensor:
        """This rank's range ``values`` (1-D) as CPU chunks the training loop cannot modify."""
        copies = [c.view(values.detach()).to("cpu", copy=True).contiguous() for c in self.mine]
        return self._sharded(copies, values.dtype)

    def into(self, values: torch.Tensor) -> tuple[ShardedTensor, Callable[[], None]]:
        """Load buffers that write into the 1-D range ``values``: views of it where a chunk is
        contiguous there, else a buffer the returned function copies in after the load."""
        buffers, pending = [], []
        for c in self.mine:
            view = c.view(values)
            if view.is_contiguous():
                buffers.append(view)
            else:
                buffers.append(torch.empty_like(view, memory_format=torch.contiguous_format))
                pending.append((view, buffers[-1]))

        def finish() -> None:
            for view, buffer in pending:
                view.copy_(buffer)

        return self._sharded(buffers, values.dtype), finish


def staged_flat(
    param: nn.Parameter,
    shard: FlatShard,
    optim_state: Mapping[nn.Parameter, dict],
    *,
    tp_rank: int,
    tp_size: int,
) -> dict[str, torch.Tensor | ShardedTensor]:
    """This rank's entries of ``param``: slot (``MODEL_SLOT`` for the weight) -> host copy.
    Scalar slots (Adam's ``step``) are written by the holder of the first element."""
    if shard.main is None:
        return {}
    layout = FlatLayout(param, shard, tp_rank=tp_rank, tp_size=tp_size)
    out: dict[str, torch.Tensor | ShardedTensor] = {MODEL_SLOT: layout.host_copy(shard.main)}
    for slot, v in sorted(optim_state.get(shard.main, {}).items()):
        if not torch.is_tensor(v):
            continue
        if v.ndim == 0:
            if shard.lo == 0:
                out[slot] = v.detach().to("cpu", copy=True)
        else:
            out[slot] = layout.host_copy(v)
    return out


def flat_targets(
    param: nn.Parameter,
    shard: FlatShard,
    slots: Mapping[str, tuple[torch.Size, torch.dtype]],
    optimizer: torch.optim.Optimizer | None,
    *,
    tp_rank: int,
    tp_size: int,
) -> tuple[dict[str, torch.Tensor | ShardedTensor], Callable[[], None]]:
    """Load buffers for this rank's range of ``param`` (``slots``: the checkpoint's entries of
    it, ``MODEL_SLOT`` included, with full size and dtype) and the function that completes the
    load. The weight loads into the main weights in place and each optimizer slot into the
    buffer that becomes its state (``optimizer``: None loads weights only)."""
    main = shard.main
    if main is None:
        return {}, lambda: None
    layout = FlatLayout(param, shard, tp_rank=tp_rank, tp_size=tp_size)
    targets: dict[str, torch.Tensor | ShardedTensor] = {}
    finishers: list[Callable[[], None]] = []
    state: dict[str, torch.Tensor] = {}
    # torch keeps Adam's step on the host unless the kernel is fused or capturable
    fused = optimizer is not None and bool(
        optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    )
    for slot, (size, dtype) in slots.items():
        if slot == MODEL_SLOT:
            targets[slot], finish = layout.into(main.detach())
        elif optimizer is None:
            continue
        elif len(size) == 0 and param.ndim > 0:
            targets[slot] = state[slot] = torch.empty(
                size, dtype=dtype, device=main.device if fused else "cpu"
            )
            continue
        else:
            state[slot] = torch.empty(main.shape, dtype=dtype, device=main.device)
            targets[slot], finish = layout.into(state[slot])
        finishers.append(finish)

    def apply() -> None:
        with torch.no_grad():
            for finish in finishers:
                finish()
        if state:
            optimizer.state[main] = state

    return targets, apply
