"""The graceful stop's single-process behaviour: a SIGTERM is only recorded, the decision says
how much grace is left and whether a save fits, and the previous handler comes back."""

from __future__ import annotations

import os
import signal

import pytest

from omni_trainer.components.graceful_stop import GracefulStop, NullStop, StopDecision


def test_sigterm_is_recorded_and_decided_at_the_step_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNI_STOP_GRACE_SECONDS", "20")
    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop(group=None)
    try:
        assert stop.grace_s == 20 and stop.decide(save_estimate_s=1.0) is None
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: only a flag is set
        decision = stop.decide(save_estimate_s=4.0)
        assert decision is not None and 19 < decision.grace_left_s <= 20
        assert decision.can_save  # 20 s > 1.5 x 4 s + 1 s
        assert not StopDecision(grace_left_s=6.0, save_estimate_s=4.0).can_save
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert NullStop().decide(save_estimate_s=0) is None
