"""Adaptive CP sharding: long samples zig-zag over all ranks, short ones whole, work balanced."""

from __future__ import annotations

import itertools
import random

import pytest

from omni_trainer.balance.cp import causal_work, plan_cp_sharding, zigzag_chunks


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
        adaptive.append(plan_cp_sharding(lengths, cp=4, threshold=1024).max_over_mean_work)
        whole.append(plan_cp_sharding(lengths, cp=4, threshold=10**9).max_over_mean_work)
    assert sum(adaptive) / len(adaptive) < 1.05
    assert sum(adaptive) < sum(whole)


def test_bad_cp_is_rejected() -> None:
    with pytest.raises(ValueError, match="cp must be >= 1"):
        plan_cp_sharding([10], cp=0, threshold=5)
