"""A ZeRO-1 rank's flat range of a (tensor-parallel) parameter as DCP chunks of the full tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from omni_trainer.checkpoint.flat_shards import FlatLayout, FlatShard, flat_boxes
from omni_trainer.models.init import shard_of


@pytest.mark.parametrize("shape", [[7], [3, 5], [2, 3, 4], [4, 1, 6]])
def test_boxes_cover_a_flat_range_in_order(shape: list[int]) -> None:
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            got = [full[tuple(slice(o, o + s) for o, s in zip(at, size, strict=True))].reshape(-1)
                   for at, size in flat_boxes(shape, lo, hi)]  # fmt: skip
            assert torch.equal(torch.cat(got), torch.arange(lo, hi)), (shape, lo, hi)
            assert len(got) <= 2 * len(shape) - 1


def _tp_param(local: list[int], *, dim: int, stride: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(local))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


@pytest.mark.parametrize(("dim", "stride"), [(0, 1), (0, 2), (1, 1), (1, 2)])
def test_chunks_place_every_ranks_range_in_the_full_tensor(dim: int, stride: int) -> None:
    """tp2 x dp3 (uneven ranges): each rank's chunks hold the full tensor's values where the
    metadata says, together they tile it once, and each rank's metadata covers it."""
    tp, full_shape = 2, [8, 12]
    full = torch.arange(96, dtype=torch.float32).view(full_shape)
    local_shape = list(full_shape)
    local_shape[dim] //= tp
    param = _tp_param(local_shape, dim=dim, stride=stride)
    covered = torch.zeros(full_shape)
    for t in range(tp):
        local = shard_of(full, param, tp_rank=t, tp_size=tp).reshape(-1)
        for lo, hi in [(0, 17), (17, 30), (30, 48)]:
            layout = FlatLayout(param, FlatShard(lo, hi, None, peer=1), tp_rank=t, tp_size=tp)
            assert sum(math.prod(c.sizes) for c in layout.everyone) == full.numel()
            for c in layout.mine:
                where = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
                assert torch.equal(c.view(local[lo:hi]), full[where]), (t, lo, c)
                covered[where] += 1
    assert torch.equal(covered, torch.ones(full_shape))
