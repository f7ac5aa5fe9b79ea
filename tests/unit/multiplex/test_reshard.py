"""Send-then-reshard (pure): each encoder output row goes to exactly the stage-0 TP rank whose
sequence shard holds its position, at the right place in that shard."""

from __future__ import annotations

import numpy as np
import pytest

from omni_trainer.multiplex.reshard import Part, plan_parts, split_at_shards


def test_a_piece_splits_at_the_shard_borders() -> None:
    # positions 6..13 over shards of 4: rank 1 keeps 6, 7; rank 2 8..11; rank 3 12, 13
    assert split_at_shards(6, 8, shard=4) == [
        Part(1, 0, 2, 2),
        Part(2, 2, 6, 0),
        Part(3, 6, 8, 0),
    ]
    assert split_at_shards(4, 4, shard=4) == [Part(1, 0, 4, 0)]


def test_every_row_lands_once_where_its_position_is() -> None:
    """Pieces of two modalities interleaved in the row: reassembling every rank's shard from
    the parts gives each position the row that the whole-sequence write gives it."""
    row, tp = 24, 3
    shard = row // tp
    positions = {"image": np.r_[2:7, 15:18], "audio": np.r_[9:14]}
    pieces = [
        ((0, 0), "image", 3),
        ((0, 1), "image", 2),
        ((1, 0), "audio", 5),
        ((0, 2), "image", 3),
    ]
    parts = plan_parts(pieces, positions, shard=shard)
    whole = {m: iter(p) for m, p in positions.items()}
    expected = {}  # position -> (piece key, row in piece)
    for key, modality, rows in pieces:
        for r in range(rows):
            expected[int(next(whole[modality]))] = (key, r)
    got = {}
    for key, ps in parts.items():
        for p in ps:
            for r in range(p.lo, p.hi):
                pos = p.tp_rank * shard + p.at + (r - p.lo)
                assert pos not in got
                got[pos] = (key, r)
    assert got == expected


def test_a_piece_across_two_items_is_refused() -> None:
    with pytest.raises(ValueError, match="one run of positions"):
        plan_parts([((0, 0), "image", 4)], {"image": np.r_[0:2, 5:7]}, shard=4)
