"""Graceful stop: SIGTERM (a pod deleted with a grace period: preemption, drain, a planned
restart) stops every rank at the same step boundary, after an emergency checkpoint if the grace
allows, and the process exits with :data:`EXIT_STOPPED`.

Only some ranks may get the signal (one preempted pod), so the decision is collective: after
each step every rank all-reduces (over a gloo group: a CPU tensor, NCCL untouched) whether it was
signalled, the least grace left anywhere and the longest a save took anywhere. Every rank then
sees the same answer and saves, or not, together. The signal handler only records the time:
the step in progress finishes normally.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from omni_trainer.distributed import comm

EXIT_STOPPED = 143
"""128 + SIGTERM, what a container stopped by SIGTERM reports: the operator reads it as "stopped
on request", never as a crash (no node is blamed, no user error)."""
GRACE_ENV = "OMNI_STOP_GRACE_SECONDS"
"""Seconds from SIGTERM to the kill (the operator sets it from the pod's grace period)."""
DEFAULT_GRACE_S = 30.0
SAVE_MARGIN = 1.5
"""An emergency checkpoint is written when the grace left exceeds this many times the longest
save so far (plus a second)."""


@dataclass(frozen=True)
class StopDecision:
    """What every rank agreed on after a step."""

    grace_left_s: float
    """The least grace left on any rank."""
    save_estimate_s: float
    """The longest complete save (blocking + background) on any rank; 0 before the first."""

    @property
    def can_save(self) -> bool:
        return self.grace_left_s > SAVE_MARGIN * self.save_estimate_s + 1.0


class GracefulStop:
    """Watches for SIGTERM from construction to :meth:`close` (main thread only).

    Args:
        group: a gloo group over every rank (None: a single process, no collective).
        grace_s: seconds from the signal to the kill (default ``OMNI_STOP_GRACE_SECONDS``).
    """

    def __init__(self, *, group: dist.ProcessGroup | None, grace_s: float | None = None) -> None:
        self.group = group
        env = os.environ.get(GRACE_ENV)
        self.grace_s = grace_s if grace_s is not None else float(env) if env else DEFAULT_GRACE_S
        self.signalled_at: float | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def grace_left(self) -> float:
        if self.signalled_at is None:
            return self.grace_s
        return self.grace_s - (time.monotonic() - self.signalled_at)

    def decide(self, *, save_estimate_s: float) -> StopDecision | None:
        """Collective, after every step on every rank: None to go on, else the agreement."""
        local = torch.tensor(
            [float(self.signalled_at is not None), -self.grace_left(), save_estimate_s],
            dtype=torch.float64,
        )
        if self.group is not None:
            comm.all_reduce(local, op="max", group=self.group)
        signalled, neg_left, estimate = local.tolist()
        if not signalled:
            return None
        return StopDecision(grace_left_s=-neg_left, save_estimate_s=estimate)

    def close(self) -> None:
        """Give SIGTERM back to whoever had it."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class NullStop:
    """No signal handling (tests, tools that run steps without a job)."""

    def decide(self, *, save_estimate_s: float) -> StopDecision | None:
        return None

    def close(self) -> None:
        pass
