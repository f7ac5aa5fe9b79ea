"""ZeRO-1 layout (pure): buckets cover every parameter once, the ranks' slices tile each bucket."""

from __future__ import annotations

import itertools

import pytest

from omni_trainer.components.distributed_optimizer import BUCKET_ALIGN, plan_buckets, plan_pieces
from omni_trainer.distributed.config import ParallelismConfig


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [1, 50, 10_000])
def test_pieces_of_every_rank_cover_each_parameter_once(shards: int, bucket_numel: int) -> None:
    numels = [7, 100, 1, 33, 64, 5]
    offsets, buckets = plan_buckets(numels, shards=shards, bucket_numel=bucket_numel)
    assert [m for b in buckets for m in b.members] == list(range(len(numels)))
    for b, nxt in itertools.pairwise(buckets):
        assert b.start + b.size == nxt.start
    for b in buckets:
        assert b.size % (shards * BUCKET_ALIGN) == 0
        assert sum(numels[i] for i in b.members) <= b.size
    covered = {i: [] for i in range(len(numels))}
    for rank in range(shards):
        for piece in plan_pieces(numels, offsets, buckets, shards=shards, rank=rank):
            bucket = buckets[piece.bucket]
            width = bucket.size // shards
            assert piece.at >= 0 and piece.at + piece.hi - piece.lo <= width
            # the piece sits where the rank's slice of the flat buffer says
            assert offsets[piece.index] + piece.lo == bucket.start + rank * width + piece.at
            covered[piece.index].append((piece.lo, piece.hi))
    for i, n in enumerate(numels):
        spans = sorted(covered[i])
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_buckets_close_at_the_size() -> None:
    _, buckets = plan_buckets([10, 10, 10, 10], shards=2, bucket_numel=20)
    assert [b.members for b in buckets] == [(0, 1), (2, 3)]


def test_distributed_optimizer_defaults_follow_data_parallel() -> None:
    par = ParallelismConfig()
    assert not par.distributed_optimizer_on(1) and par.distributed_optimizer_on(2)
    assert par.encoder_zero(1) == 0 and par.encoder_zero(2) == 2
    off = ParallelismConfig.model_validate({"distributedOptimizer": False})
    assert not off.distributed_optimizer_on(4) and off.encoder_zero(4) == 0
    explicit = ParallelismConfig.model_validate({"encoder": {"zero": 0}})
    assert explicit.distributed_optimizer_on(2) and explicit.encoder_zero(2) == 0
