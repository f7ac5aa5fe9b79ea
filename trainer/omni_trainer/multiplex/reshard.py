"""Send-then-reshard under sequence parallelism: which rows of each encoder output piece each
tensor-parallel rank of pipeline stage 0 keeps.

With sequence parallelism stage 0's TP rank ``t`` holds positions ``[t L, (t + 1) L)`` of the
packed row (``L`` = row length / tp). A piece of encoder output (one item's tokens, or an LSSP
shard of a long item) fills a contiguous run of positions, so it splits at the shard borders
into at most a few parts; each part goes to the one rank that keeps it, and that rank alone
returns its gradient. Stage 0 receives each encoded token once instead of ``tp`` times, and no
gather of embedding gradients is needed in its backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Part:
    """Rows ``[lo, hi)`` of a piece, kept by stage-0 TP rank ``tp_rank`` at ``at`` (the first
    row's position in its sequence shard)."""

    tp_rank: int
    lo: int
    hi: int
    at: int


def split_at_shards(first: int, rows: int, *, shard: int) -> list[Part]:
    """The parts of a piece whose rows fill positions ``[first, first + rows)``."""
    parts, pos, end = [], first, first + rows
    while pos < end:
        t = pos // shard
        stop = min(end, (t + 1) * shard)
        parts.append(Part(t, pos - first, stop - first, pos - t * shard))
        pos = stop
    return parts


def plan_parts(
    pieces: Iterable[tuple[object, str, int]], positions: dict[str, np.ndarray], *, shard: int
) -> dict[object, list[Part]]:
    """Every piece's parts in one micro-batch.

    Args:
        pieces: ``(key, modality, rows)`` in the order stage 0 concatenates them (encoder
            micro-batch, then piece): they consume their modality's token positions in order.
        positions: per modality, the packed-row position of each media token, items in order
            (``models.batch.media_positions``).
        shard: positions per TP rank.
    """
    used: dict[str, int] = {}
    out: dict[object, list[Part]] = {}
    for key, modality, rows in pieces:
        j = used.get(modality, 0)
        run = positions[modality][j : j + rows]
        if len(run) != rows or (rows and int(run[-1]) - int(run[0]) != rows - 1):
            raise ValueError(
                f"encoder output piece {key} of {modality} does not fill one run of positions "
                f"(rows {j}..{j + rows} of {len(positions[modality])})"
            )
        used[modality] = j + rows
        out[key] = split_at_shards(int(run[0]) if rows else 0, rows, shard=shard)
    return out
