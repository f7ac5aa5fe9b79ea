"""The loader snapshot is independent of the live state, cheap, and round-trips exactly."""

from __future__ import annotations

import numpy as np

from omni_trainer.checkpoint.loader_state import (
    PER_RANK,
    SHARED,
    deserialize,
    file_for,
    serialize,
    snapshot,
)


def test_snapshot_is_not_reached_by_later_mutation() -> None:
    live = {"cursors": [1, 2, 3], "buffer": [[0, 5, 1], [1, 7, 0]], "mixer": {"total": 1.25}}
    snap = snapshot(live)
    live["cursors"].append(4)
    live["buffer"][0][1] = 99
    live["mixer"]["total"] = 2.0
    assert snap == {
        "cursors": [1, 2, 3],
        "buffer": [[0, 5, 1], [1, 7, 0]],
        "mixer": {"total": 1.25},
    }


def test_arrays_are_copied_and_serialized_as_lists() -> None:
    live = {"tokens": np.arange(4)}
    snap = snapshot(live)
    live["tokens"][0] = 7
    assert deserialize(serialize(snap)) == {"tokens": [0, 1, 2, 3]}


def test_floats_round_trip_exactly() -> None:
    state = {"x": [0.1, 1 / 3, 1e-300, 123456789.123456789]}
    assert deserialize(serialize(snapshot(state))) == state


def test_per_rank_or_shared_file() -> None:
    assert file_for(3, SHARED) == "loader/rank-00000.json"
    assert file_for(3, PER_RANK) == "loader/rank-00003.json"


def test_long_lists_are_encoded_in_slices_to_the_same_json() -> None:
    state = {"ids": list(range(50_000)), "nested": [[i, i + 1] for i in range(40_000)], "e": []}
    assert deserialize(serialize(state)) == state
