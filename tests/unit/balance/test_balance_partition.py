"""k-way partitioning: exact cover, cardinality, determinism, and quality against brute force.

What is asserted about quality, and why:
- KK is a heuristic: it is not optimal even for k=2 (``[8, 7, 6, 5, 4]``: KK leaves a difference
  of 2, the optimum is 0). Checked exactly, together with greedy's worse difference of 4.
- Against brute force on small random instances, KK's max load stays within the proven k-way LDM
  ratio 4/3 - 1/(3k) of the optimum (Michiels, Korst, Aarts, van Leeuwen, Spieksma 2007), and
  its average ratio is no worse than greedy LPT's.
- On skewed items (8-16 per part), KK is within 5% of :func:`lower_bound` (the issue's target);
  balanced KK followed by :func:`improve_by_swaps` is within 5% of the cardinality-aware bound.
  (Raw balanced KK is not: it only combines whole runs of k items.)
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from omni_trainer.balance import (
    EncoderCost,
    Partition,
    greedy_lpt,
    improve_by_swaps,
    karmarkar_karp,
    lower_bound,
    no_reorder,
)

PLANNERS = {
    "kk": lambda w, k: karmarkar_karp(w, k),
    "kk-eq": lambda w, k: karmarkar_karp(w, k, equal_cardinality=True),
    "lpt": lambda w, k: greedy_lpt(w, k),
    "lpt-eq": lambda w, k: greedy_lpt(w, k, equal_cardinality=True),
    "none": lambda w, k: no_reorder(w, k),
    "none-rr": lambda w, k: no_reorder(w, k, layout="round_robin"),
}


def _check_cover(p: Partition, weights: list[float], k: int) -> None:
    assert p.k == k
    flat = [i for part in p.parts for i in part]
    assert sorted(flat) == list(range(len(weights)))  # every item once, none duplicated
    for part, load in zip(p.parts, p.loads, strict=True):
        assert list(part) == sorted(part)
        assert load == pytest.approx(sum(weights[i] for i in part))


def _brute_force(weights: list[float], k: int, *, equal: bool) -> float:
    n = len(weights)
    best = float("inf")
    base, extra = divmod(n, k)
    for assign in itertools.product(range(k), repeat=n - 1):
        assign = (0, *assign)  # symmetry: item 0 in part 0
        if equal:
            counts = sorted(assign.count(p) for p in range(k))
            if counts != [base] * (k - extra) + [base + 1] * extra:
                continue
        loads = [0.0] * k
        for i, p in enumerate(assign):
            loads[p] += weights[i]
        best = min(best, max(loads))
    return best


def test_classic_instance_kk_beats_greedy_but_is_not_optimal() -> None:
    weights = [8, 7, 6, 5, 4]
    kk = karmarkar_karp(weights, 2)
    assert sorted(kk.loads) == [14, 16]  # difference 2 (optimum: 8+7 | 6+5+4, difference 0)
    assert sorted(greedy_lpt(weights, 2).loads) == [13, 17]  # difference 4
    assert _brute_force(weights, 2, equal=False) == 15
    balanced = karmarkar_karp(weights, 2, equal_cardinality=True)
    assert sorted(len(p) for p in balanced.parts) == [2, 3]


@pytest.mark.parametrize("k", [2, 3])
def test_kk_against_brute_force(k: int) -> None:
    rng = random.Random(7)
    ratio = 4 / 3 - 1 / (3 * k)
    kk_ratios, lpt_ratios = [], []
    for _ in range(40):
        n = rng.randint(k, 8 if k == 2 else 7)
        weights = [float(rng.randint(1, 100)) for _ in range(n)]
        for equal in (False, True):
            opt = _brute_force(weights, k, equal=equal)
            kk = karmarkar_karp(weights, k, equal_cardinality=equal)
            lpt = greedy_lpt(weights, k, equal_cardinality=equal)
            assert opt - 1e-9 <= kk.max_load
            assert lower_bound(weights, k) <= opt + 1e-9
            if not equal:
                assert kk.max_load <= ratio * opt + 1e-9
                kk_ratios.append(kk.max_load / opt)
                lpt_ratios.append(lpt.max_load / opt)
            else:
                assert kk.max_load <= 2 * opt  # loose: balanced LDM has no tighter proven bound
    assert np.mean(kk_ratios) <= np.mean(lpt_ratios)


def test_property_many_random_batches() -> None:
    rng = random.Random(1)
    for trial in range(300):
        k = rng.randint(1, 9)
        n = rng.randint(0, 40)
        weights = [rng.lognormvariate(0, 1.0) * (trial % 5 != 0) for _ in range(n)]
        weights[: n // 4] = [float(round(w)) for w in weights[: n // 4]]  # ties and zeros
        for name, plan in PLANNERS.items():
            p = plan(weights, k)
            _check_cover(p, weights, k)
            assert p == plan(list(weights), k), name  # deterministic
            better = improve_by_swaps(weights, p)
            _check_cover(better, weights, k)
            assert better.max_load <= p.max_load + 1e-9
            assert sorted(map(len, better.parts)) == sorted(map(len, p.parts))
            assert p.max_load >= lower_bound(weights, k) - 1e-9 if n else True
            if name.endswith("-eq") or name.startswith("none"):
                sizes = sorted(len(part) for part in p.parts)
                assert sizes[-1] - sizes[0] <= 1, (name, sizes)
                assert sizes == sorted([n // k + (p_ < n % k) for p_ in range(k)]), name


def test_lower_bound_and_max_over_mean() -> None:
    assert lower_bound([10, 1, 1], 2) == 10
    assert lower_bound([3, 3, 3, 3], 2) == 6
    assert lower_bound([], 3) == 0
    # cardinality-aware: the part of the 10 also holds one of the two ones
    assert lower_bound([10, 1, 1, 1], 2, equal_cardinality=True) == 11
    assert lower_bound([10, 1], 2, equal_cardinality=True) == 10
    p = Partition(parts=((0,), (1,)), loads=(3.0, 1.0))
    assert p.max_over_mean == 1.5
    assert Partition(parts=((), ()), loads=(0.0, 0.0)).max_over_mean == 1.0


@pytest.mark.parametrize(("k", "per_part"), [(2, 8), (8, 8), (8, 16), (32, 8)])
def test_kk_within_five_percent_of_lower_bound_on_many_items(k: int, per_part: int) -> None:
    # OpenImages-like lengths (lognormal, mean 3800, sigma 0.6), ViT-L-like cost.
    cost = EncoderCost(linear=6.05e8, quadratic=9.8e4)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        lengths = rng.lognormal(np.log(3800) - 0.18, 0.6, size=k * per_part)
        weights = [cost(x) for x in np.clip(lengths, 256, 16384)]
        kk = karmarkar_karp(weights, k)
        assert kk.max_load <= 1.05 * lower_bound(weights, k)
        assert kk.max_load < no_reorder(weights, k).max_load
        balanced = improve_by_swaps(weights, karmarkar_karp(weights, k, equal_cardinality=True))
        assert set(map(len, balanced.parts)) == {per_part}
        assert balanced.max_load <= 1.05 * lower_bound(weights, k, equal_cardinality=True)


def test_swaps_fix_the_classic_instance() -> None:
    kk = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(improve_by_swaps([8, 7, 6, 5, 4], kk).loads) == [15, 15]


def test_invalid_input() -> None:
    with pytest.raises(ValueError, match="k"):
        karmarkar_karp([1.0], 0)
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        greedy_lpt([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="weights"):
        karmarkar_karp([float("nan")], 2)
    with pytest.raises(ValueError, match="layout"):
        no_reorder([1.0], 1, layout="zigzag")  # type: ignore[arg-type]
