"""PhaseTimer: wall time on the CPU, CUDA events on GPUs with one wait per step."""

from __future__ import annotations

import time

import torch

from omni_trainer.components.timing import PhaseTimer


class _FakeEvent:
    """torch.cuda.Event stand-in: a clock reading at record(), counted synchronize() calls."""

    clock = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA reports


def test_events_sum_per_phase_and_wait_once(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError))
    timer = PhaseTimer(events=True)
    for phase, seconds in [("data", 0.5), ("encoder", 2.0), ("data", 0.25)]:
        with timer.span(phase):
            _FakeEvent.clock += seconds
    assert _FakeEvent.synchronized == 0  # nothing waits inside the step
    assert timer.take() == {"data": 0.75, "encoder": 2.0}
    assert _FakeEvent.synchronized == 1
    assert timer.take() == {}


def test_wall_time_on_cpu() -> None:
    timer = PhaseTimer()
    with timer.span("sync"):
        time.sleep(0.01)
    assert 0.01 <= timer.take()["sync"] < 1.0


def test_the_op_log_is_off_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("OMNI_OP_LOG", raising=False)
    timer = PhaseTimer()
    with timer.span("encoder"), timer.mark("llm_forward"):
        pass
    assert timer.take_log() == [] and set(timer.take()) == {"encoder"}


def test_the_op_log_keeps_spans_and_marks_in_order(monkeypatch) -> None:
    """Marks (LLM forwards) are logged but counted in no phase: ``llm`` stays what no span
    covers."""
    monkeypatch.setenv("OMNI_OP_LOG", "1")
    timer = PhaseTimer()
    with timer.span("encoder"):
        time.sleep(0.002)
    with timer.mark("llm_forward"):
        time.sleep(0.002)
    log = timer.take_log()
    assert [name for name, _, _ in log] == ["encoder", "llm_forward"]
    assert all(0.002 <= end - start < 1.0 for _, start, end in log)
    assert log[0][2] <= log[1][1]
    assert set(timer.take()) == {"encoder"} and timer.take_log() == []
    assert PhaseTimer(events=True).take_log() == []  # GPUs: events, no wall-time log
