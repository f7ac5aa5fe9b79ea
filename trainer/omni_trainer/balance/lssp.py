"""Long-short sequence parallelism (LSSP) for the modality encoders: which rank encodes what.

Per micro-batch, the encoder samples of one sequence-parallel group are split by length (paper,
technique 2): a sample of at most ``eta`` tokens is encoded whole by one rank (data parallel; the
ranks' loads balanced by longest-processing-time-first on ``cost``), a longer one by all ranks of
the group together (Ulysses sequence parallelism, ``models/ulysses.py``), each rank holding a
contiguous shard of its tokens. The plan is pure arithmetic on the lengths, so every rank computes
the same plan without communicating. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


def shard_sizes(n: int, parts: int) -> list[int]:
    """Contiguous shard sizes of ``n`` tokens over ``parts`` ranks: as even as possible, the first
    ``n % parts`` ranks one token more (e.g. 37 over 4 -> ``[10, 9, 9, 9]``).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if n < 0:
        raise ValueError(f"cannot shard a negative length {n}")
    base, extra = divmod(n, parts)
    return [base + (r < extra) for r in range(parts)]


def shard_offsets(sizes: Sequence[int]) -> list[int]:
    """Start token of each contiguous shard: ``[0, s0, s0+s1, ...]`` (one per shard)."""
    offsets, start = [], 0
    for size in sizes:
        offsets.append(start)
        start += size
    return offsets


@dataclass(frozen=True)
class TokenRange:
    """Tokens ``[start, stop)`` of one sample's encoder output, held by ``rank`` of the group."""

    rank: int
    start: int
    stop: int


@dataclass(frozen=True, kw_only=True)
class LSSPPlan:
    """Who encodes which sample of a micro-batch, and where each output lands.

    Sample indices refer to the ``lengths`` given to :func:`plan_lssp`; ranks are group ranks.
    """

    eta: int
    """Longest sample encoded whole by one rank."""
    lengths: tuple[int, ...]
    """Tokens of each sample."""
    short: tuple[tuple[int, ...], ...]
    """Per rank, the samples it encodes alone, ascending (the order it packs them in)."""
    long: tuple[int, ...]
    """Samples encoded by the whole group with sequence parallelism, in this order (ascending)."""
    placement: tuple[tuple[TokenRange, ...], ...]
    """Per sample, the ranks holding its output and which tokens: one full range for a short
    sample, one contiguous shard per rank (``shard_sizes``, rank order) for a long one."""
    rank_cost: tuple[float, ...]
    """Per rank, the cost of its short samples plus ``1 / group_size`` of every long one."""

    @property
    def group_size(self) -> int:
        """Ranks in the group."""
        return len(self.short)

    def shard_sizes(self, sample: int) -> list[int]:
        """Tokens of ``sample`` held by each rank (0 for ranks that hold none)."""
        sizes = [0] * self.group_size
        for r in self.placement[sample]:
            sizes[r.rank] = r.stop - r.start
        return sizes


def plan_lssp(
    lengths: Sequence[int], *, eta: int, group_size: int, cost: Callable[[int], float]
) -> LSSPPlan:
    """Split a micro-batch's encoder samples into data-parallel short ones and sequence-parallel
    long ones, for one group of ``group_size`` ranks.

    Short samples (``length <= eta``) are placed longest-processing-time first: by decreasing
    cost (ties: lower index first), each onto the least-loaded rank (ties: lower rank), which
    keeps the heaviest rank within ``4/3 - 1/(3 * group_size)`` of the optimum (Graham 1969).
    Long samples cost every rank the same share, so they do not change the placement.

    Args:
        lengths: tokens of each sample.
        eta: longest sample a single rank encodes; longer ones are sequence parallel.
        group_size: ranks in the sequence-parallel group.
        cost: relative encoding cost of one sample of that many tokens (e.g. the encoder
            config's ``flops([n])``); must be deterministic, so that every rank plans the same.

    Returns:
        The plan, identical on every rank given identical arguments.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"sample lengths must be >= 0, got {list(lengths)}")
    costs = [float(cost(n)) for n in lengths]
    long = tuple(i for i, n in enumerate(lengths) if n > eta)
    load = [sum(costs[i] for i in long) / group_size] * group_size
    short: list[list[int]] = [[] for _ in range(group_size)]
    for i in sorted((i for i, n in enumerate(lengths) if n <= eta), key=lambda i: (-costs[i], i)):
        rank = min(range(group_size), key=lambda r: (load[r], r))
        short[rank].append(i)
        load[rank] += costs[i]
    placement: list[tuple[TokenRange, ...]] = [()] * len(lengths)
    for rank, samples in enumerate(short):
        for i in samples:
            placement[i] = (TokenRange(rank, 0, lengths[i]),)
    for i in long:
        sizes = shard_sizes(lengths[i], group_size)
        placement[i] = tuple(
            TokenRange(r, start, start + size)
            for r, (start, size) in enumerate(zip(shard_offsets(sizes), sizes, strict=True))
        )
    return LSSPPlan(
        eta=eta,
        lengths=tuple(lengths),
        short=tuple(tuple(sorted(s)) for s in short),
        long=long,
        placement=tuple(placement),
        rank_cost=tuple(load),
    )
