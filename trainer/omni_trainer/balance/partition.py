"""k-way number partitioning: split item weights into ``k`` parts with the smallest largest part.

Reordering inside a group assigns samples to the group's ranks; a step waits for the most loaded
rank, so the objective is the maximum part load (makespan). Three planners, one result type:

- :func:`karmarkar_karp`: the largest differencing method (LDM), the planner the paper uses.
  Near-optimal on many skewed items, and in its balanced form it gives every rank the same number
  of samples, which keeps micro-batch counts equal across data-parallel ranks.
- :func:`greedy_lpt`: longest processing time first, the usual baseline.
- :func:`no_reorder`: the split the data arrived in, the reference a planner must beat.

Every function is deterministic (ties broken by item index, then by creation order) so that all
ranks of a group compute the same plan from the same gathered metadata without talking.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Partition:
    """Items split into ``k`` parts.

    ``parts[p]`` lists the item indices of part ``p`` in increasing order; ``loads[p]`` is the sum
    of their weights. Every index in ``range(n)`` appears in exactly one part.
    """

    parts: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]

    @property
    def k(self) -> int:
        """Number of parts."""
        return len(self.parts)

    @property
    def max_load(self) -> float:
        """Load of the busiest part: what a synchronous step waits for."""
        return max(self.loads, default=0.0)

    @property
    def max_over_mean(self) -> float:
        """``max_load / mean_load``: 1.0 is perfect balance; 1.0 too when there is no load."""
        total = sum(self.loads)
        if total <= 0:
            return 1.0
        return self.max_load * len(self.loads) / total


def lower_bound(weights: Sequence[float], k: int, *, equal_cardinality: bool = False) -> float:
    """No partition's max load is below this: the mean part load, or the heaviest single item.

    Items are indivisible, so one huge sample bounds the step on its own however well the rest
    is spread. With ``equal_cardinality`` every part holds at least ``n // k`` items, so the part
    of the heaviest item also carries the ``n // k - 1`` lightest others: a tighter bound when a
    few items dominate.
    """
    _check(weights, k)
    if not weights:
        return 0.0
    heaviest = max(weights)
    if equal_cardinality:
        others = sorted(weights)[: len(weights) // k]  # the lightest; the heaviest is not among
        others = others[: max(len(weights) // k - 1, 0)]  # them unless n <= k (then none taken)
        heaviest += math.fsum(others)
    return max(math.fsum(weights) / k, heaviest)


def karmarkar_karp(
    weights: Sequence[float], k: int, *, equal_cardinality: bool = False
) -> Partition:
    """Largest differencing method (Karmarkar-Karp), k-way, in O(n log n + n k log k).

    Each item starts as a k-tuple of subsets: the item alone plus ``k - 1`` empty subsets
    (``equal_cardinality=False``), or, in the balanced variant, the weights are sorted and cut
    into runs of ``k`` consecutive items, each run one tuple with one item per subset. The two
    tuples with the largest spread (max - min subset sum) are then combined, heaviest subset of
    one with the lightest of the other, until one tuple is left: large differences cancel first,
    which is why LDM beats greedy on skewed weights.

    Args:
        weights: non-negative item costs; item ``i`` is ``weights[i]``.
        k: number of parts (ranks), >= 1.
        equal_cardinality: every part gets ``n // k`` or ``n // k + 1`` items. Implemented by
            padding with zero-weight dummies to a multiple of ``k`` (all dummies fall into the
            last run, at most one per part) and combining whole runs, which keeps every subset
            at the same count.

    The balanced variant can only combine whole runs, so with few items per part (8 per rank)
    it lands 10-35% above the bound on skewed weights; follow it with :func:`improve_by_swaps`,
    which brings it within ~1-3% of ``lower_bound(..., equal_cardinality=True)``
    (``bench/balance.py``). :func:`~omni_trainer.balance.reorder.plan_reorder` does.

    Returns:
        The partition. Part order carries no meaning (parts are ranked by load, lightest first);
        :func:`~omni_trainer.balance.reorder.plan_reorder` maps parts to ranks.
    """
    _check(weights, k)
    n = len(weights)
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    # A tuple keeps only its non-empty subsets, as (sums, members) sorted by sum ascending; the
    # other k - len(sums) subsets are empty (sum 0) and implied in front. Sparse tuples make the
    # many early combinations of the unconstrained method cost O(items), not O(k). Sorting is
    # stable, so ties keep their construction order: deterministic.
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    if equal_cardinality:
        padded = order + [-1] * (-n % k)  # -1: a zero-weight dummy
        for start in range(0, len(padded), k):
            run = padded[start : start + k][::-1]  # ascending weight
            sums = [float(weights[i]) if i >= 0 else 0.0 for i in run]
            members = [[i] if i >= 0 else [] for i in run]
            heap.append((sums[0] - sums[-1], len(heap), sums, members))
    else:
        for i in order:
            heap.append((-float(weights[i]), len(heap), [float(weights[i])], [[i]]))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a_sums, a_mem = heapq.heappop(heap)
        _, _, b_sums, b_mem = heapq.heappop(heap)
        sums, members = _combine(a_sums, a_mem, b_sums, b_mem, k)
        low = sums[0] if len(sums) == k else 0.0
        heapq.heappush(heap, (low - sums[-1], seq, sums, members))
        seq += 1
    if not heap:
        return Partition(parts=((),) * k, loads=(0.0,) * k)
    _, _, sums, members = heap[0]
    return _result(weights, [[] for _ in range(k - len(members))] + members)


def _combine(
    a_sums: list[float], a_mem: list[list[int]], b_sums: list[float], b_mem: list[list[int]], k: int
) -> tuple[list[float], list[list[int]]]:
    """KK's step: subsets of ``a`` by descending sum joined with those of ``b`` by ascending sum.

    Empty subsets are implied, so only positions with a non-empty side are built.
    """
    # Dense positions pair a's j-th heaviest with b's j-th lightest; both are non-empty only
    # for the o = sa + sb - k lightest subsets of each (a's reversed): those are joined, the
    # heavier subsets of both face empty ones and pass through.
    o = max(0, len(a_sums) + len(b_sums) - k)
    sums = [a_sums[o - 1 - t] + b_sums[t] for t in range(o)] + a_sums[o:] + b_sums[o:]
    members = [_merge(a_mem[o - 1 - t], b_mem[t]) for t in range(o)] + a_mem[o:] + b_mem[o:]
    rank = sorted(range(len(sums)), key=sums.__getitem__)
    return [sums[j] for j in rank], [members[j] for j in rank]


def greedy_lpt(weights: Sequence[float], k: int, *, equal_cardinality: bool = False) -> Partition:
    """Longest processing time first: heaviest item to the currently lightest part.

    The classic baseline (Graham: within 4/3 - 1/(3k) of optimal). It cannot undo an early
    choice, so two large items landing on balanced parts leave a gap that small items must fill;
    :func:`karmarkar_karp` does better when few items per part remain to fill such gaps.

    Args:
        weights: non-negative item costs.
        k: number of parts, >= 1.
        equal_cardinality: as in :func:`karmarkar_karp`: ``n // k`` or ``n // k + 1`` items per
            part (only ``n % k`` parts may take the extra item); a full part is skipped.

    Returns:
        The partition; part ``p`` is the ``p``-th part opened (ties to the lower part index).
    """
    _check(weights, k)
    n = len(weights)
    base, extra = divmod(n, k)
    members: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, p) for p in range(k)]
    extras_used = 0
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        while True:
            load, p = heapq.heappop(heap)
            size = len(members[p])
            if not equal_cardinality or size < base or (size == base and extras_used < extra):
                break
            # full part: dropped for good (sizes only grow, the extra budget only shrinks)
        members[p].append(i)
        if equal_cardinality and size == base:
            extras_used += 1
        heapq.heappush(heap, (load + weights[i], p))
    return _result(weights, members)


def no_reorder(
    weights: Sequence[float],
    k: int,
    *,
    layout: Literal["contiguous", "round_robin"] = "contiguous",
) -> Partition:
    """The split the data came in, as the reference for the gain of reordering.

    Args:
        weights: non-negative item costs, in arrival order.
        k: number of parts, >= 1.
        layout: ``contiguous``: part ``p`` gets items ``[p*n//k, (p+1)*n//k)`` (items listed rank
            by rank, as a metadata all-gather returns them); ``round_robin``: item ``i`` goes to
            part ``i % k`` (a loader that deals samples out one at a time).

    Returns:
        The partition, part ``p`` being rank ``p`` of the group.
    """
    _check(weights, k)
    n = len(weights)
    if layout == "contiguous":
        members = [list(range(p * n // k, (p + 1) * n // k)) for p in range(k)]
    elif layout == "round_robin":
        members = [list(range(p, n, k)) for p in range(k)]
    else:
        raise ValueError(f"layout must be 'contiguous' or 'round_robin', got {layout!r}")
    return _result(weights, members)


def _merge(a: list[int], b: list[int]) -> list[int]:
    """Union of two member lists, reusing the longer one (small-to-large: O(n log n) in total)."""
    if len(a) < len(b):
        a, b = b, a
    a.extend(b)
    return a


def _result(weights: Sequence[float], members: Sequence[Sequence[int]]) -> Partition:
    parts = tuple(tuple(sorted(m)) for m in members)
    loads = tuple(math.fsum(weights[i] for i in part) for part in parts)
    return Partition(parts=parts, loads=loads)


def _check(weights: Sequence[float], k: int) -> None:
    if k < 1:
        raise ValueError(f"k (number of parts) must be >= 1, got {k}")
    for i, w in enumerate(weights):
        if not w >= 0 or math.isinf(w):  # also rejects NaN
            raise ValueError(f"weights must be finite and >= 0; weights[{i}] = {w}")


def improve_by_swaps(
    weights: Sequence[float], partition: Partition, *, max_rounds: int | None = None
) -> Partition:
    """Local search after a constructive planner: swap one item of the busiest part with a lighter
    item of another part while that lowers the busiest part's load.

    Swaps keep every part's item count, so an equal-cardinality plan stays one. Balanced KK cuts
    the items into runs of ``k`` and can only combine whole runs, so with few items per part it
    leaves a residue of a few percent; one or two swaps usually remove it. Deterministic: the
    best swap is the one leaving the lower pair maximum (first in item order on ties); numpy,
    O(n * items per part) per swap.

    Args:
        weights: the item costs the partition was built from.
        partition: a partition of ``range(len(weights))``.
        max_rounds: swaps at most (default ``2 * n``); each strictly lowers the sorted load vector.

    Returns:
        The improved partition (the input itself when no swap helps).
    """
    n = len(weights)
    w = np.asarray(weights, dtype=np.float64)
    part_of = np.empty(n, dtype=np.int64)
    for p, part in enumerate(partition.parts):
        part_of[list(part)] = p
    loads = np.array(partition.loads, dtype=np.float64)
    changed = False
    for _ in range(2 * n if max_rounds is None else max_rounds):
        p = int(np.argmax(loads))  # first maximum: ties to the lowest part
        inside, outside = np.flatnonzero(part_of == p), np.flatnonzero(part_of != p)
        if not len(inside) or not len(outside):
            break
        delta = w[inside][:, None] - w[outside][None, :]  # load leaving p per swap
        new_max = np.maximum(loads[p] - delta, loads[part_of[outside]][None, :] + delta)
        new_max[(delta <= 0) | (new_max >= loads[p])] = np.inf
        best = int(np.argmin(new_max))  # first minimum: by item of p, then other item
        if not np.isfinite(new_max.flat[best]):
            break
        i, j = inside[best // len(outside)], outside[best % len(outside)]
        q = int(part_of[j])
        part_of[i], part_of[j] = q, p
        loads[p] = w[part_of == p].sum()
        loads[q] = w[part_of == q].sum()
        changed = True
    if not changed:
        return partition
    return _result(weights, [np.flatnonzero(part_of == p).tolist() for p in range(partition.k)])
