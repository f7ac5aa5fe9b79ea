"""The operator's Prometheus metrics: jobs by phase, restarts, recovery time, reconcile health.

One :class:`OperatorMetrics` per operator process, with its own ``CollectorRegistry`` (tests build
as many as they like). Pure: imports neither kopf nor a Kubernetes client; the handlers call it
(``with metrics.reconcile("create"): ...``) and the startup handler calls :meth:`serve`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

from omni_operator.status import Phase
from omni_trainer.components.metrics import MetricsEndpoint

PREFIX = "omni_operator_"
PHASES: tuple[str, ...] = get_args(Phase)
"""Every phase gets a series (0 when no job is in it), so a phase emptying shows as 0."""
DEFAULT_PORT = 9090

_RECOVER_BUCKETS = (5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
_RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class OperatorMetrics(MetricsEndpoint):
    """Prometheus metrics of the operator process."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.jobs = Gauge(PREFIX + "jobs", "OmniTrainingJobs by phase.", ("phase",), registry=r)
        self.restarts = Counter(
            PREFIX + "restarts",
            "Whole-job restarts the operator performed, by classified failure reason.",
            ("reason",),
            registry=r,
        )
        self.time_to_recover = Histogram(
            PREFIX + "time_to_recover_seconds",
            "From failure detection until the restarted job trains again.",
            buckets=_RECOVER_BUCKETS,
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            PREFIX + "reconcile_duration_seconds",
            "Latency of one handler invocation.",
            ("handler",),
            buckets=_RECONCILE_BUCKETS,
            registry=r,
        )
        self.reconcile_errors = Counter(
            PREFIX + "reconcile_errors",
            "Handler invocations that raised, by handler and exception type.",
            ("handler", "error"),
            registry=r,
        )
        self.quarantined_nodes = Gauge(
            PREFIX + "quarantined_nodes",
            "Nodes the operator avoids after failures attributed to them.",
            registry=r,
        )
        self.straggler_nodes = Gauge(
            PREFIX + "straggler_nodes",
            "Nodes persistently slower than their job's other nodes (condition Straggler).",
            registry=r,
        )
        self.set_jobs_by_phase({})

    def serve(self, port: int = DEFAULT_PORT, *, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` (default: the operator's port). Returns the port bound."""
        return super().serve(port, addr=addr)

    def set_jobs_by_phase(self, counts: Mapping[str, int]) -> None:
        """Replace the per-phase job counts (a timer or index recounts; phases absent -> 0).

        Raises:
            ValueError: for a phase the status model does not know (bounded label values).
        """
        unknown = set(counts) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown phases {sorted(unknown)}; known: {list(PHASES)}")
        for phase in PHASES:
            self.jobs.labels(phase).set(counts.get(phase, 0))

    def record_restart(self, reason: str) -> None:
        """Count one whole-job restart; ``reason`` is the failure class (node_lost, ...)."""
        self.restarts.labels(reason).inc()

    def observe_recovery(self, seconds: float) -> None:
        """Time from detecting a failure to the restarted job's first step."""
        self.time_to_recover.observe(seconds)

    def set_quarantined_nodes(self, count: int) -> None:
        self.quarantined_nodes.set(count)

    def set_straggler_nodes(self, count: int) -> None:
        self.straggler_nodes.set(count)

    @contextmanager
    def reconcile(self, handler: str) -> Iterator[None]:
        """Time a handler body; an exception is counted by type and re-raised unchanged.

        ``kopf.TemporaryError`` ("not ready yet") is counted too, under its own ``error``
        label, so dashboards can tell waiting from failing.
        """
        start = time.perf_counter()
        try:
            yield
        except BaseException as err:
            self.reconcile_errors.labels(handler, type(err).__name__).inc()
            raise
        finally:
            self.reconcile_seconds.labels(handler).observe(time.perf_counter() - start)


class NullOperatorMetrics:
    """When the operator serves no metrics: same methods as :class:`OperatorMetrics`, no effect."""

    def serve(self, port: int = DEFAULT_PORT, *, addr: str = "0.0.0.0") -> int:
        return 0

    def close(self) -> None:
        pass

    def set_jobs_by_phase(self, counts: Mapping[str, int]) -> None:
        pass

    def record_restart(self, reason: str) -> None:
        pass

    def observe_recovery(self, seconds: float) -> None:
        pass

    def set_quarantined_nodes(self, count: int) -> None:
        pass

    def set_straggler_nodes(self, count: int) -> None:
        pass

    @contextmanager
    def reconcile(self, handler: str) -> Iterator[None]:
        yield


class Fleet:
    """What the operator-wide gauges are computed from: each job's last phase, quarantine and
    the start of its current recovery (pure bookkeeping, fed by every reconcile)."""

    def __init__(self) -> None:
        self.phases: dict[tuple[str, str], str] = {}
        self.quarantined: dict[tuple[str, str], int] = {}
        self.stragglers: dict[tuple[str, str], int] = {}
        self.recovering_since: dict[tuple[str, str], float] = {}

    def observe(
        self, job: tuple[str, str], *, phase: str, quarantined: int, now: float, stragglers: int = 0
    ) -> float | None:
        """Record a job's state; returns the recovery time when a restart just came back."""
        before = self.phases.get(job)
        self.phases[job] = phase
        self.quarantined[job] = quarantined
        self.stragglers[job] = stragglers
        if phase == "Restarting" and before != "Restarting":
            self.recovering_since[job] = now
        elif phase == "Running" and job in self.recovering_since:
            return now - self.recovering_since.pop(job)
        return None

    def forget(self, job: tuple[str, str]) -> None:
        for table in (self.phases, self.quarantined, self.stragglers, self.recovering_since):
            table.pop(job, None)

    def export(self, metrics: OperatorMetrics | NullOperatorMetrics) -> None:
        counts: dict[str, int] = {}
        for phase in self.phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        metrics.set_jobs_by_phase(counts)
        metrics.set_quarantined_nodes(sum(self.quarantined.values()))
        metrics.set_straggler_nodes(sum(self.stragglers.values()))
