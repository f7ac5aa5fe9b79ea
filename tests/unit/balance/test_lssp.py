"""LSSP planning: short samples data parallel (balanced), long ones sequence parallel (sharded)."""

from __future__ import annotations

import itertools
import random

import pytest

from omni_trainer.balance.lssp import LSSPPlan, TokenRange, plan_lssp, shard_sizes


def quadratic(n: int) -> float:
    """Encoder-like cost: linear layers plus attention."""
    return 100.0 * n + n * n


def _random_lengths(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, 64), rng.randint(65, 400)]) for _ in range(count)]


@pytest.mark.parametrize(
    ("n", "parts", "expected"),
    [
        (37, 2, [19, 18]),
        (37, 4, [10, 9, 9, 9]),
        (8, 4, [2, 2, 2, 2]),
        (3, 4, [1, 1, 1, 0]),
        (0, 2, [0, 0]),
    ],
)
def test_shard_sizes_even_first_ranks_get_extra(n: int, parts: int, expected: list[int]) -> None:
    assert shard_sizes(n, parts) == expected


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_placed_once_and_split_by_eta(seed: int) -> None:
    lengths = _random_lengths(seed, 12)
    group = 1 + seed % 4
    plan = plan_lssp(lengths, eta=64, group_size=group, cost=quadratic)
    assert plan.group_size == group
    encoded = [i for rank in plan.short for i in rank] + list(plan.long)
    assert sorted(encoded) == list(range(len(lengths)))
    assert all(lengths[i] <= 64 for rank in plan.short for i in rank)
    assert list(plan.long) == [i for i, n in enumerate(lengths) if n > 64]
    for rank, samples in enumerate(plan.short):
        assert list(samples) == sorted(samples)
        for i in samples:
            assert plan.placement[i] == (TokenRange(rank, 0, lengths[i]),)
    for i in plan.long:
        ranges = plan.placement[i]
        assert [r.rank for r in ranges] == list(range(group))
        assert [r.stop - r.start for r in ranges] == shard_sizes(lengths[i], group)
        assert ranges[0].start == 0 and ranges[-1].stop == lengths[i]
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))  # contiguous
        assert sum(plan.shard_sizes(i)) == lengths[i]
    # every output token is produced by exactly one rank
    produced = sorted(
        (i, r.start, r.stop) for rank in range(group) for i, r in local_outputs(plan, rank)
    )
    assert produced == sorted(
        (i, r.start, r.stop) for i, rs in enumerate(plan.placement) for r in rs
    )


def _optimum(costs: list[float], group: int) -> float:
    """Brute-force best makespan (small instances only)."""
    best = float("inf")
    for assignment in itertools.product(range(group), repeat=len(costs)):
        load = [0.0] * group
        for c, r in zip(costs, assignment, strict=True):
            load[r] += c
        best = min(best, max(load))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_short_balance_within_lpt_bound(seed: int) -> None:
    rng = random.Random(seed)
    group = 2 + seed % 3
    lengths = [rng.randint(1, 64) for _ in range(7)]
    plan = plan_lssp(lengths, eta=64, group_size=group, cost=quadratic)
    costs = [quadratic(n) for n in lengths]
    assert plan.long == ()
    assert plan.rank_cost == pytest.approx([sum(costs[i] for i in rank) for rank in plan.short])
    assert max(plan.rank_cost) <= (4 / 3 - 1 / (3 * group)) * _optimum(costs, group) + 1e-9
    assert max(plan.rank_cost) <= sum(costs) / group + max(costs) + 1e-9  # list-scheduling bound


def local_outputs(plan: LSSPPlan, rank: int) -> list[tuple[int, TokenRange]]:
    """What ``rank`` produces, in the order it encodes: its short samples packed together, then
    its shard of each long sample, as ``(sample, token range)`` pairs."""
    out = [(i, plan.placement[i][0]) for i in plan.short[rank]]
    out += [(i, plan.placement[i][rank]) for i in plan.long]
    return out


def test_long_samples_cost_every_rank_a_share() -> None:
    plan = plan_lssp([500, 10, 10], eta=100, group_size=2, cost=quadratic)
    share = quadratic(500) / 2
    assert plan.long == (0,)
    assert plan.short == ((1,), (2,))
    assert plan.rank_cost == pytest.approx([share + quadratic(10)] * 2)
    assert local_outputs(plan, 1) == [(2, TokenRange(1, 0, 10)), (0, TokenRange(1, 250, 500))]


def test_ties_are_deterministic() -> None:
    lengths = [8, 8, 8, 8, 8, 300, 8]
    a = plan_lssp(lengths, eta=64, group_size=4, cost=quadratic)
    b = plan_lssp(list(lengths), eta=64, group_size=4, cost=quadratic)
    assert a == b
    # equal costs: lower index first, onto the lower rank among equally loaded ones
    assert a.short == ((0, 4), (1, 6), (2,), (3,))


def test_eta_boundary_and_bad_arguments() -> None:
    plan = plan_lssp([64, 65], eta=64, group_size=2, cost=float)
    assert plan.long == (1,) and plan.short == ((0,), ())
    with pytest.raises(ValueError, match="group_size"):
        plan_lssp([1], eta=4, group_size=0, cost=float)
    with pytest.raises(ValueError, match="eta"):
        plan_lssp([1], eta=-1, group_size=2, cost=float)
    with pytest.raises(ValueError, match="lengths"):
        plan_lssp([-3], eta=4, group_size=2, cost=float)
