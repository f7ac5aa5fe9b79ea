"""Adaptive CP sharding: long samples zig-zag over all ranks, short ones whole, work balanced."""

from __future__ import annotations

import itertools
import random

import pytest

from omni_trainer.balance.cp import (
    WHOLE_SHARE,
    CPPlan,
    adaptive_threshold,
    causal_work,
    plan_context_parallel,
    plan_cp_sharding,
    zigzag_chunks,
)


def max_over_mean_work(plan: CPPlan) -> float:
    """The busiest rank's attention work over the mean: 1.0 is perfectly balanced."""
    total = sum(plan.work)
    return max(plan.work) * len(plan.work) / total if total else 1.0


def test_causal_work_counts_query_key_pairs() -> None:
    assert causal_work(0, 4) == 1 + 2 + 3 + 4
    assert causal_work(2, 4) == 3 + 4


def test_zigzag_gives_every_rank_the_same_causal_work() -> None:
    for cp in (2, 4, 8):
        chunks = zigzag_chunks(64 * cp, cp)
        work = [sum(causal_work(a, b) for a, b in rank) for rank in chunks]
        assert len(set(work)) == 1
        covered = sorted(r for rank in chunks for r in rank)
        assert covered[0][0] == 0 and covered[-1][1] == 64 * cp
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_every_token_of_every_sample_is_placed_exactly_once() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 4000) for _ in range(rng.randint(1, 12))]
        plan = plan_cp_sharding(lengths, cp=4, threshold=1024)
        seen = [0] * len(lengths)
        for rank in plan.ranges:
            for i, start, stop in rank:
                assert 0 <= start < stop <= lengths[i]
                seen[i] += stop - start
        assert seen == lengths
        assert set(plan.sharded) == {i for i, n in enumerate(lengths) if n > 1024}
        for i in range(len(lengths)):  # short samples stay whole on one rank
            if i not in plan.sharded:
                assert sum(1 for rank in plan.ranges for s, _, _ in rank if s == i) == 1


def test_adaptive_sharding_balances_attention_better_than_whole_samples() -> None:
    rng = random.Random(1)
    adaptive, whole = [], []
    for _ in range(100):
        lengths = [int(rng.lognormvariate(6.5, 1.0)) + 1 for _ in range(16)]
        adaptive.append(max_over_mean_work(plan_cp_sharding(lengths, cp=4, threshold=1024)))
        whole.append(max_over_mean_work(plan_cp_sharding(lengths, cp=4, threshold=10**9)))
    assert sum(adaptive) / len(adaptive) < 1.05
    assert sum(adaptive) < sum(whole)


def test_bad_cp_is_rejected() -> None:
    with pytest.raises(ValueError, match="cp must be >= 1"):
        plan_cp_sharding([10], cp=0, threshold=5)


def _contiguous_work(lengths: list[int], cp: int) -> list[int]:
    """Causal work per rank if the packed tokens were cut into ``cp`` equal contiguous slices
    (what sharding a packed row without regard to samples would give)."""
    total = sum(lengths)
    cuts = [total * r // cp for r in range(cp + 1)]
    work = [0] * cp
    offset = 0
    for n in lengths:
        for r in range(cp):
            a, b = max(cuts[r], offset), min(cuts[r + 1], offset + n)
            if b > a:
                work[r] += causal_work(a - offset, b - offset)
        offset += n
    return work


def test_context_plan_never_loses_or_duplicates_a_token_and_respects_capacity() -> None:
    """The trainer's plan: every token of every sample on exactly one rank, no rank over its
    share of the micro-batch (symmetric dispatch), short samples whole where they fit."""
    rng = random.Random(2)
    for _ in range(500):
        cp = rng.choice((2, 3, 4, 8))
        capacity = rng.randint(8, 512)
        lengths: list[int] = []
        room = cp * capacity - rng.randint(0, capacity)
        while room > 0 and len(lengths) < 24:
            n = min(room, max(1, int(rng.lognormvariate(4.0, 1.2))))
            lengths.append(n)
            room -= n
        plan = plan_context_parallel(lengths, cp=cp, capacity=capacity)
        owner: dict[tuple[int, int], int] = {}
        for r, rank in enumerate(plan.ranges):
            assert sum(b - a for _, a, b in rank) == plan.tokens[r] <= capacity
            assert plan.work[r] == sum(causal_work(a, b) for _, a, b in rank)
            for i, a, b in rank:
                for t in range(a, b):
                    assert (i, t) not in owner, "a token placed twice"
                    owner[(i, t)] = r
        assert sorted(owner) == [(i, t) for i, n in enumerate(lengths) for t in range(n)]
        threshold = adaptive_threshold(lengths, cp=cp, capacity=capacity)
        assert set(plan.sharded) == {i for i, n in enumerate(lengths) if n > threshold}


def test_context_plan_balances_causal_work() -> None:
    """Long samples split with equal work, short ones placed by LPT: the busiest rank is within
    the LPT bound, near the mean, and never worse than cutting the packed row contiguously."""
    rng = random.Random(3)
    ratios, contiguous = [], []
    for _ in range(300):
        cp, capacity = 4, 4096
        lengths = [min(capacity, 1 + int(rng.lognormvariate(6.0, 1.0))) for _ in range(12)]
        while sum(lengths) > cp * capacity:
            lengths.pop()
        plan = plan_context_parallel(lengths, cp=cp, capacity=capacity)
        mean = sum(plan.work) / cp
        whole = [causal_work(0, lengths[i]) for i in range(len(lengths)) if i not in plan.sharded]
        # LPT: the busiest rank took its last sample when it was the least loaded (+ rounding
        # of the zig-zag chunks of the sharded samples: at most one query row each)
        slack = max(lengths) * len(plan.sharded)
        assert max(plan.work) <= mean + max(whole, default=0) + slack
        assert max(whole, default=0) <= WHOLE_SHARE * mean
        ratios.append(max_over_mean_work(plan))
        contiguous.append(max(_contiguous_work(lengths, cp)) * cp / sum(plan.work))
    assert sum(ratios) / len(ratios) < 1.06
    assert sum(ratios) < 0.8 * sum(contiguous)


def test_adaptive_threshold_keeps_only_samples_within_a_quarter_share() -> None:
    # work 5050 + 210 + 55 = 5315: a quarter of a rank's share (cp 2) is 664: 100 is too long
    assert adaptive_threshold([100, 20, 10], cp=2, capacity=128) == 20
    assert adaptive_threshold([30] * 8, cp=2, capacity=128) == 30  # 465 <= 0.25 * 1860
    assert adaptive_threshold([60, 60, 60, 60], cp=2, capacity=128) == 0  # 1830 > 915
    assert adaptive_threshold([200], cp=2, capacity=128) == 0  # over capacity: always sharded


def test_a_sample_that_fits_nowhere_whole_is_cut_over_the_ranks_with_room() -> None:
    plan = plan_cp_sharding([20, 20, 20], cp=2, threshold=24, capacity=32)
    assert plan.tokens == (32, 28) or plan.tokens == (28, 32)
    assert (
        sum(
            len({r for r, rank in enumerate(plan.ranges) for s, *_ in rank if s == i}) > 1
            for i in range(3)
        )
        == 1
    )
