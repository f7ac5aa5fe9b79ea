"""The trainer's /metrics endpoint, served on loopback, scraped over HTTP and parsed."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_trainer.components.metrics import (
    PHASES,
    NullTrainerMetrics,
    TrainerMetrics,
    restart_attempt_from_env,
)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name + sorted labels -> value, as Prometheus would read them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
        text = rsp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.fixture
def served() -> Iterator[tuple[TrainerMetrics, int]]:
    m = TrainerMetrics(job="tiny", rank=3, stage=1, restart_attempt=2)
    port = m.serve(0, addr="127.0.0.1")
    yield m, port
    m.close()


STEP = dict(
    loss=2.5,
    lr=3e-4,
    tokens_per_s=12345.0,
    mfu=0.41,
    step_seconds=0.75,
    phases={"data": 0.05, "encoder": 0.2, "encoder_wait": 0.01, "llm": 0.4, "sync": 0.08},
    samples={"image": 4, "audio": 2, "text": 10},
    mixture={"image": 0.3, "audio": 0.2, "text": 0.5},
    encoder_activation_peak_bytes=1 << 20,
    media_bytes_read=3000,
)


def test_scraped_values_match_recorded(served: tuple[TrainerMetrics, int]) -> None:
    m, port = served
    m.record_step(step=1, **STEP)
    m.record_step(step=2, **{**STEP, "loss": 2.25, "samples": {"image": 1}})
    m.record_checkpoint(
        step=200, seconds=4.0, blocking_seconds=0.5, age=10.0, loader_snapshot_seconds=0.1
    )
    m.record_node_busy({0: 0.25, 1: 0.5})
    got = scrape(port)

    def at(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"training_job": "tiny", **labels}.items())))]

    rank = {"rank": "3", "stage": "1"}

    assert at("omni_trainer_step") == 2
    assert at("omni_trainer_steps_total") == 2
    assert at("omni_trainer_loss") == 2.25
    assert at("omni_trainer_learning_rate") == pytest.approx(3e-4)
    assert at("omni_trainer_tokens_per_second") == 12345.0
    assert at("omni_trainer_mfu_ratio") == pytest.approx(0.41)
    assert at("omni_trainer_restart_attempt") == 2
    assert at("omni_trainer_checkpoint_step") == 200
    assert at("omni_trainer_samples_total", modality="image") == 5
    assert at("omni_trainer_samples_total", modality="text") == 10
    assert at("omni_trainer_mixture_share", modality="audio") == 0.2
    assert at("omni_trainer_encoder_activation_peak_bytes", **rank) == 1 << 20
    assert at("omni_trainer_media_bytes_read_total", **rank) == 6000
    assert at("omni_trainer_step_duration_seconds_count", **rank) == 2
    assert at("omni_trainer_step_duration_seconds_sum", **rank) == pytest.approx(1.5)
    phase = {p: at("omni_trainer_phase_seconds_total", **rank, phase=p) for p in PHASES}
    assert phase["llm"] == pytest.approx(0.8)
    assert phase["pipeline_wait"] == 0  # exported before it ever happened
    assert phase["checkpoint_blocking"] == pytest.approx(0.5)
    assert phase["loader_snapshot"] == pytest.approx(0.1)
    assert at("omni_trainer_node_busy_seconds", node_rank="1") == 0.5
    assert at("omni_trainer_node_busy_seconds", node_rank="0") == 0.25
    assert at("omni_trainer_checkpoint_duration_seconds_sum") == 4.0
    assert at("omni_trainer_checkpoint_blocking_seconds_count") == 1
    state_time = at("omni_trainer_checkpoint_last_complete_timestamp_seconds")
    assert time.time() - state_time == pytest.approx(10.0, abs=5)


def test_registries_are_independent_and_ports_free() -> None:
    a, b = TrainerMetrics(job="a"), TrainerMetrics(job="b")
    pa, pb = a.serve(0, addr="127.0.0.1"), b.serve(0, addr="127.0.0.1")
    try:
        assert pa != pb
        a.record_step(step=7, **STEP)
        assert scrape(pa)[("omni_trainer_step", (("training_job", "a"),))] == 7
        assert ("omni_trainer_step", (("training_job", "a"),)) not in scrape(pb)
        with pytest.raises(RuntimeError, match="already serving"):
            a.serve(0)
    finally:
        a.close()
        b.close()
        a.close()  # idempotent


def test_unknown_phase_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown step phases"):
        TrainerMetrics(job="x").record_step(step=1, **{**STEP, "phases": {"bubble": 1.0}})


def test_restart_attempt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert restart_attempt_from_env({}) == 0
    assert restart_attempt_from_env({"OMNI_RESTART_ATTEMPT": "3"}) == 3
    with pytest.raises(ValueError, match="OMNI_RESTART_ATTEMPT"):
        restart_attempt_from_env({"OMNI_RESTART_ATTEMPT": "three"})
    monkeypatch.setenv("OMNI_RESTART_ATTEMPT", "4")
    m = TrainerMetrics(job="j")
    assert m.registry.get_sample_value("omni_trainer_restart_attempt", {"training_job": "j"}) == 4


def test_null_object_has_the_same_methods() -> None:
    public = {n for n in dir(TrainerMetrics) if not n.startswith("_")}
    assert public <= set(dir(NullTrainerMetrics))
    null = NullTrainerMetrics()
    assert null.serve(0) == 0
    null.record_step(step=1, **STEP)
    null.record_checkpoint(step=1, seconds=1.0, blocking_seconds=0.1)
    null.close()
