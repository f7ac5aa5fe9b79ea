"""ZeRO-1 layout (pure): buckets cover every parameter once, the ranks' slices tile each bucket."""

from __future__ import annotations

import itertools

import pytest
import torch

from omni_trainer.components.distributed_optimizer import (
    BUCKET_ALIGN,
    Bucket,
    _BucketOverlap,
    plan_buckets,
    plan_pieces,
)
from omni_trainer.distributed import comm
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


def test_a_parameter_named_alone_takes_a_bucket_of_its_own() -> None:
    """Tied embedding copies: the same rows of the weight on both stages whatever sits around it."""
    _, buckets = plan_buckets([10, 10, 10, 10], shards=2, bucket_numel=100, alone=frozenset({1}))
    assert [b.members for b in buckets] == [(0,), (1,), (2, 3)]
    _, first = plan_buckets([10, 5], shards=2, bucket_numel=100, alone=frozenset({0}))
    assert [b.members for b in first] == [(0,), (1,)]
    # the copy's bucket has the same size wherever it sits, so each rank owns the same rows
    assert buckets[1].size == first[0].size


class _Params:
    """What :class:`_BucketOverlap` reads of its :class:`DistributedMainParams`."""

    def __init__(self, members: list[tuple[int, ...]]) -> None:
        self.buckets = [Bucket(10 * b, 10, m) for b, m in enumerate(members)]
        self.model_params = [torch.zeros(2) for m in members for _ in m]
        self.group = None

    def bucket_view(self, b: int) -> torch.Tensor:
        return torch.full((4,), float(b))

    def wire_view(self, b: int) -> torch.Tensor:
        return self.bucket_view(b)


@pytest.fixture
def started(monkeypatch) -> list[int]:
    """The buckets whose reduce-scatter started, in order (the collective replaced)."""
    order: list[int] = []

    class Done:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def wait(self) -> torch.Tensor:
            return self.t[:2]

    def start(tensor: torch.Tensor, *, group) -> Done:
        order.append(int(tensor[0]))
        return Done(tensor)

    monkeypatch.setattr(comm, "reduce_scatter_start", start)
    return order


def test_overlap_starts_final_buckets_from_the_last_down(started: list[int]) -> None:
    overlap = _BucketOverlap(_Params([(0, 1), (2,), (3, 4)]))
    overlap.arm(2)
    for i in range(5):  # the first micro-batch: nothing is final
        overlap.arrived(i)
    assert started == []
    overlap.arrived(0)
    overlap.arrived(1)  # bucket 0 final, but bucket 2 (first in the order) is not
    assert started == []
    overlap.arrived(4)
    overlap.arrived(3)
    assert started == [2]
    overlap.arrived(2)  # bucket 1 final: it starts, then the waiting bucket 0
    assert started == [2, 1, 0]
    reduced = overlap.finish()
    assert [float(t[0]) for t in reduced] == [0.0, 1.0, 2.0] and overlap.early == 3


def test_finish_starts_the_rest_in_the_same_order(started: list[int]) -> None:
    """A parameter without a gradient in the last micro-batch: its bucket (and the ones after it
    in the order) start at the end, in the order every rank uses."""
    overlap = _BucketOverlap(_Params([(0,), (1,), (2,)]))
    overlap.arm(1)
    overlap.arrived(2)
    overlap.arrived(0)  # bucket 1 never final
    assert started == [2]
    overlap.finish()
    assert started == [2, 1, 0] and overlap.early == 1


def test_a_gradient_after_its_bucket_started_is_an_error(started: list[int]) -> None:
    overlap = _BucketOverlap(_Params([(0,)]))
    overlap.arm(1)
    overlap.arrived(0)
    overlap.arrived(0)  # a second backward through the same weight
    with pytest.raises(RuntimeError, match="overlapGradReduce: false"):
        overlap.finish()


def test_overlap_needs_the_distributed_optimizer() -> None:
    par = ParallelismConfig()
    assert not par.overlap_grad_reduce_on(1) and par.overlap_grad_reduce_on(2)
    sync = ParallelismConfig.model_validate({"overlapGradReduce": False})
    assert not sync.overlap_grad_reduce_on(2)
    with pytest.raises(ValueError, match=r"overlapGradReduce.*distributedOptimizer: true"):
        ParallelismConfig.model_validate({"overlapGradReduce": True, "distributedOptimizer": False})


def test_gradient_reduction_precision_is_fp32_unless_asked() -> None:
    assert ParallelismConfig().grad_reduce_dtype == "fp32"
    assert ParallelismConfig.model_validate({"gradReduceDtype": "bf16"}).grad_reduce_dtype == "bf16"
    with pytest.raises(ValueError, match="gradReduceDtype"):
        ParallelismConfig.model_validate({"gradReduceDtype": "fp16"})
