"""Adaptive sample sharding for context parallelism (the paper's technique 9, CP half).

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


def zigzag_chunks(length: int, cp: int) -> list[list[tuple[int, int]]]:
    """Per rank, its two chunks of a sample cut into ``2 * cp`` near-equal pieces."""
    pieces = 2 * cp
    bounds = [length * i // pieces for i in range(pieces + 1)]
    chunk = [(bounds[i], bounds[i + 1]) for i in range(pieces)]
    return [[chunk[r], chunk[pieces - 1 - r]] for r in range(cp)]


def plan_cp_sharding(
    lengths: Sequence[int], *, cp: int, threshold: int, capacity: int | None = None
) -> CPPlan:
    """Shard long samples zig-zag over ``cp`` ranks, place short ones whole by LPT.

    Args:
        lengths: tokens of each packed sample of a micro-batch.
        cp: context-parallel ranks.
        threshold: longest sample kept whole on one rank.
        capacity: tokens a rank holds at most (symmetric dispatch: every rank's local sequence
            has this length). A sample that fits on no rank whole is cut over the ranks with room
            instead, so nothing is lost as long as ``sum(lengths) <= cp * capacity``.
    """
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    room_total = None if capacity is None else cp * capacity
    if room_total is not None and sum(lengths) > room_total:
        raise ValueError(f"{sum(lengths)} tokens do not fit {cp} ranks of {capacity}")
    ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    work = [0] * cp
    tokens = [0] * cp

    def room(r: int) -> float:
        return float("inf") if capacity is None else capacity - tokens[r]

    def place(r: int, i: int, start: int, stop: int) -> None:
        ranges[r].append((i, start, stop))
        work[r] += causal_work(start, stop)
        tokens[r] += stop - start

    def fill(i: int) -> None:
        """Cut sample ``i`` into consecutive pieces over the least-loaded ranks with room."""
        start = 0
        for r in sorted(range(cp), key=lambda r: (work[r], tokens[r], r)):
            stop = start + int(min(room(r), lengths[i] - start))
            if stop > start:
                place(r, i, start, stop)
            start = stop
        assert start == lengths[i], "capacity checked above"

    sharded = tuple(i for i, n in enumerate(lengths) if n > threshold and cp > 1)
    for i in sharded:
        chunks = zigzag_chunks(lengths[i], cp)
        if any(sum(b - a for a, b in c) > room(r) for r, c in enumerate(chunks)):
            fill(i)
            continue
        for r, rank_chunks in enumerate(chunks):
            for start, stop in rank_chunks:
                if stop > start:
                    place(r, i, start, stop)
    whole = set(sharded)
    for i in sorted(
        (i for i in range(len(lengths)) if i not in whole), key=lambda i: (-lengths[i], i)
    ):
        fits = [r for r in range(cp) if room(r) >= lengths[i]]
        if fits:
            place(min(fits, key=lambda r: (work[r], tokens[r], r)), i, 0, lengths[i])
        else:
            fill(i)
    return CPPlan(
        ranges=tuple(tuple(sorted(x)) for x in ranges),
        work=tuple(work),
        tokens=tuple(tokens),
        sharded=sharded,
    )


WHOLE_SHARE = 0.25
"""A sample stays whole if its causal attention is at most this fraction of a rank's fair share
of the micro-batch's: LPT then keeps the busiest rank within 1 + WHOLE_SHARE of the mean."""


def adaptive_threshold(lengths: Sequence[int], *, cp: int, capacity: int) -> int:
    """The longest sample worth keeping whole: it fits one rank and its causal attention is at
    most ``WHOLE_SHARE`` of a rank's fair share (longer ones would make a rank straggle).

    Args:
        lengths: tokens of each packed sample of a micro-batch.
        cp: context-parallel ranks.
        capacity: tokens per rank.
    """
    share = WHOLE_SHARE * sum(causal_work(0, n) for n in lengths) / cp
    return max((n for n in lengths if n <= capacity and causal_work(0, n) <= share), default=0)


def plan_context_parallel(lengths: Sequence[int], *, cp: int, capacity: int) -> CPPlan:
    """The plan the trainer uses: :func:`plan_cp_sharding` at the :func:`adaptive_threshold`."""
    threshold = adaptive_threshold(lengths, cp=cp, capacity=capacity)
    return plan_cp_sharding(lengths, cp=cp, threshold=threshold, capacity=capacity)
