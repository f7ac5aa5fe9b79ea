"""Adaptive sample sharding for context parallelism (PAPER.md technique 9, the CP half).

With packed samples, sharding EVERY sample across the CP ranks wastes the short ones (their
attention is tiny, their communication is not), while keeping long ones whole overloads one rank
(attention grows with the square of the length). So: samples longer than ``threshold`` are split
over all CP ranks in zig-zag order (rank r takes chunks r and 2*cp-1-r, which equalises causal
attention work), shorter ones stay whole and are spread over the ranks by LPT on their attention
cost (hybrid data parallelism). Pure arithmetic: every rank computes the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def causal_work(start: int, stop: int) -> int:
    """Query-key pairs of causal attention for queries ``[start, stop)`` of one sample."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


@dataclass(frozen=True)
class CPPlan:
    """Per CP rank, the (sample, start, stop) token ranges it attends for, and its work."""

    ranges: tuple[tuple[tuple[int, int, int], ...], ...]
    work: tuple[int, ...]
    tokens: tuple[int, ...]
    sharded: tuple[int, ...]
    """Samples split across all ranks (the long ones)."""

    @property
    def max_over_mean_work(self) -> float:
        total = sum(self.work)
        return max(self.work) * len(self.work) / total if total else 1.0


def zigzag_chunks(length: int, cp: int) -> list[list[tuple[int, int]]]:
    """Per rank, its two chunks of a sample cut into ``2 * cp`` near-equal pieces."""
    pieces = 2 * cp
    bounds = [length * i // pieces for i in range(pieces + 1)]
    chunk = [(bounds[i], bounds[i + 1]) for i in range(pieces)]
    return [[chunk[r], chunk[pieces - 1 - r]] for r in range(cp)]


def plan_cp_sharding(lengths: Sequence[int], *, cp: int, threshold: int) -> CPPlan:
    """Shard long samples zig-zag over ``cp`` ranks, place short ones whole by LPT.

    Args:
        lengths: tokens of each packed sample of a micro-batch.
        cp: context-parallel ranks.
        threshold: longest sample kept whole on one rank.
    """
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    work = [0] * cp
    tokens = [0] * cp
    sharded = tuple(i for i, n in enumerate(lengths) if n > threshold and cp > 1)
    for i in sharded:
        for r, chunks in enumerate(zigzag_chunks(lengths[i], cp)):
            for start, stop in chunks:
                if stop > start:
                    ranges[r].append((i, start, stop))
                    work[r] += causal_work(start, stop)
                    tokens[r] += stop - start
    short = [i for i in range(len(lengths)) if i not in set(sharded)]
    for i in sorted(short, key=lambda i: (-lengths[i], i)):
        r = min(range(cp), key=lambda r: (work[r], tokens[r], r))
        ranges[r].append((i, 0, lengths[i]))
        work[r] += causal_work(0, lengths[i])
        tokens[r] += lengths[i]
    return CPPlan(
        ranges=tuple(tuple(sorted(x)) for x in ranges),
        work=tuple(work),
        tokens=tuple(tokens),
        sharded=sharded,
    )
