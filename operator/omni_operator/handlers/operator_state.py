"""What every handler of one operator process shares (kept in kopf's memo): the API client, the
progress and report sources, the per-job locks and wake-ups, the operator's metrics, and what
the last reconciles saw of the jobs' nodes.

A job's reconcile runs under its own lock; one that may place pods also holds the operator-wide
``placing`` lock from its observation (every pod of the cluster, the queued jobs) to its writes,
so two jobs never place onto the same free capacity.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_operator import reconcile as rec
from omni_operator.handlers.kube import Kube
from omni_operator.metrics import Fleet, NullOperatorMetrics, OperatorMetrics
from omni_operator.spec import OmniTrainingJob

ProgressSource = Callable[
    [OmniTrainingJob, Sequence[dict[str, Any]]], Awaitable[rec.Progress | None]
]
"""Reads the trainer's progress (step, checkpoint, tokens/s, MFU) for a job from its pods."""
ReportSource = Callable[[list[dict[str, Any]]], Awaitable[dict[str, dict[str, Any]]]]
"""Reads the failed attempts in-place pods' supervisors report (pod name -> failure)."""


JobKey = tuple[str, str]  # (namespace, name)


class Wakeup:
    """Why a job's reconcile loop should run now; many pokes before it runs count as one."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason = ""

    def poke(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    async def wait(
        self, timeout: float | None, *, stop: asyncio.Future[Any] | None = None
    ) -> str | None:
        """The reason of the first poke within ``timeout`` seconds (None: timed out, or
        ``stop`` finished first)."""
        poked = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({poked} | ({stop} if stop else set()), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            poked.cancel()  # no-op once done; never left pending (timeout, stop, cancellation)
        if not poked.done() or poked.cancelled():
            return None
        self._event.clear()
        return self.reason


@dataclass
class OperatorState:
    """Shared by every handler of this operator process (kept in kopf's memo)."""

    kube: Kube = field(default_factory=Kube)
    progress: ProgressSource | None = None
    """Default: the trainer's metrics endpoint (``progress.MetricsProgress``). None: no source
    (no hang detection; a crash is never taken for a user error)."""
    reports: ReportSource | None = None
    """Default: each unready in-place pod's supervisor (``reports.SupervisorReports``). None:
    none read (a failure then shows only when a container ends)."""
    volcano: bool = False
    locks: dict[JobKey, asyncio.Lock] = field(default_factory=dict)
    metrics: OperatorMetrics | NullOperatorMetrics = field(default_factory=NullOperatorMetrics)
    fleet: Fleet = field(default_factory=Fleet)
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(tz=dt.UTC)
    """The time reconciles see (tests move it forward instead of sleeping through timeouts)."""
    resync_seconds: float = 10.0
    """The longest a job goes unreconciled (progress polling, missed events)."""
    wakeups: dict[JobKey, Wakeup] = field(default_factory=dict)
    placing: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a reconcile that may place pods, from its observation to its writes."""
    job_nodes: dict[JobKey, frozenset[str]] = field(default_factory=dict)
    """The nodes each job's pods are placed on, as its last reconcile saw them."""
    node_facts: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """What placement and recovery read from each Node, as last seen (heartbeats excluded)."""

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def wakeup(self, key: JobKey) -> Wakeup:
        return self.wakeups.setdefault(key, Wakeup())

    def forget(self, key: JobKey) -> None:
        self.locks.pop(key, None)
        self.wakeups.pop(key, None)
        self.job_nodes.pop(key, None)
        self.fleet.forget(key)
