"""A restart record once the trainer reports the step it resumed from (pure)."""

from __future__ import annotations

from omni_operator.status import RestartRecord


def test_steps_recomputed_counts_from_the_step_reached_to_the_step_resumed_from() -> None:
    """Known once the trainer says where it resumed: after a graceful stop (the operator could
    not know of its emergency checkpoint) and after a fallback past a corrupt checkpoint."""
    graceful = RestartRecord(attempt=1, reason="PodDeleted", from_step=10, reached_step=14)
    assert graceful.steps_recomputed is None
    assert graceful.resumed(14).steps_recomputed == 0  # the emergency checkpoint
    fallback = RestartRecord(attempt=2, reason="PodFailed", from_step=60, reached_step=60,
                             steps_recomputed=0)  # fmt: skip
    done = fallback.resumed(46)
    assert (done.from_step, done.steps_recomputed, done.confirmed) == (46, 14, True)
    legacy = RestartRecord(attempt=1, reason="PodFailed", from_step=20, steps_recomputed=3)
    assert legacy.resumed(15).steps_recomputed == 8  # reached 23, from before reachedStep
    assert RestartRecord(attempt=1, reason="Hang").resumed(0).from_step is None
