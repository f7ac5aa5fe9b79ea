"""Busy time per step and its per-node window medians (the figures stragglers are found by)."""

from __future__ import annotations

import pytest

from omni_trainer.components.stragglers import (
    BusyTracker,
    busy_seconds,
    node_medians,
    node_rank_from_env,
)


def test_busy_time_is_the_step_minus_the_waits_for_peers() -> None:
    phases = {"llm": 0.5, "peer_wait": 0.3, "pipeline_wait": 0.1, "encoder_wait": 0.05,
              "sync": 0.2, "data": 0.1}  # fmt: skip
    assert busy_seconds(1.25, phases) == pytest.approx(0.8)
    assert busy_seconds(0.1, {"peer_wait": 0.2}) == 0.0  # never negative


def test_node_rank_is_torchruns_group_rank_else_derived_from_the_local_world() -> None:
    assert node_rank_from_env(5, {"GROUP_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == 3
    assert node_rank_from_env(9, {"LOCAL_WORLD_SIZE": "4"}) == 2
    assert node_rank_from_env(2, {}) == 2


def test_a_node_is_as_slow_as_its_slowest_rank() -> None:
    reports = [(1, 0.2), (0, 0.25), (1, 0.4), (0, 0.1)]
    assert node_medians(reports) == {0: 0.25, 1: 0.4}


def test_the_tracker_reports_a_window_median_every_n_steps() -> None:
    tracker = BusyTracker(node_rank=0, every=3, window=3, warmup=0)  # a world of one
    assert tracker.observe(1, 0.1) is None
    assert tracker.observe(2, 5.0) is None  # one slow step does not move the median much
    assert tracker.observe(3, 0.2) == {0: 0.2}
    for step in (4, 5):
        assert tracker.observe(step, 1.0) is None
    assert tracker.observe(6, 1.0) == {0: 1.0}  # the window forgot the old steps
    with pytest.raises(ValueError, match="every and window"):
        BusyTracker(node_rank=0, every=0)


def test_an_attempt_reports_only_full_windows_after_its_warmup() -> None:
    """A resumed attempt starting at step 101: its first 2 steps (slow: warm-up) are left out,
    and no median is reported before the window holds 4 steps of the attempt."""
    tracker = BusyTracker(node_rank=0, every=2, window=4, warmup=2)
    got = {step: tracker.observe(step, busy) for step, busy in
           zip(range(101, 109), (9.0, 9.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6), strict=True)}  # fmt: skip
    assert [s for s, v in got.items() if v is not None] == [106, 108]
    assert got[106] == {0: pytest.approx(0.25)} and got[108] == {0: pytest.approx(0.45)}
