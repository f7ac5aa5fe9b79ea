"""Mixture schedule interpolation and the token shares the deficit scheduler realizes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from omni_trainer.data import (
    DataConfig,
    DeficitMixer,
    MixturePoint,
    MixtureSchedule,
    MultimodalStream,
)
from omni_trainer.data.sample import MediaGeometry

RAMP = [
    MixturePoint(at_tokens=0, weights={"image": 1, "text": 1}),
    MixturePoint(at_tokens=1_000_000, weights={"image": 13, "audio": 74, "text": 13}),
]


def test_schedule_interpolates_then_stays_constant() -> None:
    s = MixtureSchedule(RAMP)
    assert s.modalities == ("image", "audio", "text")
    assert s.weights(0) == pytest.approx({"image": 0.5, "audio": 0.0, "text": 0.5})
    mid = s.weights(500_000)
    assert mid == pytest.approx({"image": 0.315, "audio": 0.37, "text": 0.315})
    end = {"image": 0.13, "audio": 0.74, "text": 0.13}
    assert s.weights(1_000_000) == pytest.approx(end)
    assert s.weights(10**9) == pytest.approx(end)
    assert sum(s.weights(123_456).values()) == pytest.approx(1.0)


def _run(mixer: DeficitMixer, draws: int, seed: int = 0) -> list[tuple[int, int]]:
    """Draw with skewed random lengths; return (source, length) per draw."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        i = mixer.choose()
        n = int(rng.lognormal(4, 1.0 if i == 0 else 0.3)) + 1
        mixer.record(i, n)
        out.append((i, n))
    return out


def test_constant_mixture_realized_shares_and_source_weights() -> None:
    points = [MixturePoint(at_tokens=0, weights={"image": 1, "text": 3})]
    # sources: 0,1 image (weights 1:3), 2 text
    mixer = DeficitMixer(MixtureSchedule(points), [("image", 1.0), ("image", 3.0), ("text", 1.0)])
    draws = _run(mixer, 4000)
    tokens = np.zeros(3)
    for i, n in draws:
        tokens[i] += n
    total = tokens.sum()
    assert (tokens[0] + tokens[1]) / total == pytest.approx(0.25, abs=0.005)
    assert tokens[1] / (tokens[0] + tokens[1]) == pytest.approx(0.75, abs=0.01)
    assert mixer.tokens == {"image": tokens[0] + tokens[1], "text": tokens[2]}


def test_ramp_is_tracked_in_every_window() -> None:
    points = [
        MixturePoint(at_tokens=0, weights={"image": 1, "text": 1}),
        MixturePoint(at_tokens=200_000, weights={"image": 13, "audio": 74, "text": 13}),
    ]
    schedule = MixtureSchedule(points)
    mixer = DeficitMixer(schedule, [("image", 1.0), ("audio", 1.0), ("text", 1.0)])
    seen = 0
    window = np.zeros(3)
    for i, n in _run(mixer, 6000):
        window[i] += n
        seen += n
        if window.sum() >= 20_000:  # compare each 20K-token window with the schedule mid-window
            want = schedule.weights(seen - 10_000)
            got = window / window.sum()
            for j, m in enumerate(("image", "audio", "text")):
                assert got[j] == pytest.approx(want[m], abs=0.03), (seen, m)
            window[:] = 0
    assert seen > 300_000


def test_stream_draws_follow_the_configured_mixture(
    make_config: Callable[..., DataConfig],
) -> None:
    cfg = make_config(mixture=[{"atTokens": 0, "weights": {"image": 2, "audio": 1, "text": 1}}])
    stream = MultimodalStream(cfg, seed=3, vocab_size=256, geometry=MediaGeometry())
    for _ in range(8):
        stream.next_batch()
    drawn = stream.counters["drawn_tokens_per_modality"]
    total = sum(drawn.values())
    assert drawn["image"] / total == pytest.approx(0.5, abs=0.02)
    assert drawn["audio"] / total == pytest.approx(0.25, abs=0.02)
    emitted = stream.counters["tokens_per_modality"]
    assert emitted["image"] / sum(emitted.values()) == pytest.approx(0.5, abs=0.05)


def test_mixer_rejects_modality_without_source() -> None:
    with pytest.raises(ValueError, match="'audio'"):
        DeficitMixer(MixtureSchedule(RAMP), [("image", 1.0), ("text", 1.0)])
