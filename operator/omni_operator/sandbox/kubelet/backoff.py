"""A crashing container's restart back-off, as a kubelet keeps it (``flowcontrol.Backoff``).

The first crash restarts at once, each later one after a delay counted from its end that
doubles up to a cap; a crash more than twice the cap after the last restart is a first again: a
kubelet's 10 s, 5 min and 10 min, scaled by the sandbox's first back-off (pure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CRASH_BACKOFF_S = 1.0
"""The sandbox's first back-off of a crashing container (a kubelet's is 10 s)."""
CRASH_BACKOFF_CAP = 30
"""The back-off's cap, in first back-offs (a kubelet's: 5 min = 30 x 10 s)."""


@dataclass(frozen=True)
class Backoff:
    """A container's crash back-off."""

    delay: float
    """How long its next restart waits after it ends (doubling up to the cap)."""
    updated: float
    """When it last restarted (loop time): a crash more than twice the cap later starts over."""


@dataclass
class Restart:
    """A container of a running pod that ended and is restarted in place."""

    count: int
    """``restartCount`` once it runs again."""
    at: float
    """When it may start (loop time)."""
    last: dict[str, Any]
    """Its end, for ``lastState.terminated``."""


def crash_backoff(entry: Backoff | None, now: float, *, first_s: float) -> tuple[float, Backoff]:
    """(seconds to wait, the entry after) for a container ending at ``now``: a kubelet restarts
    the first crash at once, each later one after the current delay, which doubles up to
    ``CRASH_BACKOFF_CAP * first_s``; a crash more than twice that cap after the last restart is
    a first crash again (a container that ran 10 minutes fine). Pure."""
    cap = CRASH_BACKOFF_CAP * first_s
    if entry is None or now - entry.updated > 2 * cap:
        return 0.0, Backoff(first_s, now)
    return entry.delay, Backoff(min(entry.delay * 2, cap), now + entry.delay)


def go_duration(seconds: float) -> str:
    """Whole seconds as Go prints a ``time.Duration`` (``40s``, ``1m20s``, ``5m0s``), as the
    kubelet's CrashLoopBackOff message does."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
