"""The trainer's Prometheus endpoint: throughput, MFU, where step time goes, data mix, checkpoints.

One :class:`TrainerMetrics` per exporting rank, each with its own ``CollectorRegistry`` (no
process-global state: tests and several ranks in one process never collide). Ranks that do not
export get :class:`NullTrainerMetrics`, which has the same methods and does nothing, so the
training loop never branches on "is metrics enabled".

Job-wide figures (loss, tokens/s, MFU, mixture) carry only the ``training_job`` label; what
differs between ranks (step-time phases, encoder activation peak) also carries ``rank`` and
``stage`` (pipeline stage). Prometheus adds ``pod``/``namespace`` through the PodMonitor. The
label is ``training_job``, not ``job``, because Prometheus owns ``job`` (the scrape job).

Everything here takes plain numbers: the module imports neither torch nor the trainer, so the
operator image and the unit tests can load it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from omni_trainer.pod_protocol import (
    ATTEMPT_METRIC,
    CHECKPOINT_STEP_METRIC,
    METRIC_PREFIX,
    MFU_METRIC,
    NODE_BUSY_METRIC,
    RESUMED_FROM_METRIC,
    STEP_METRIC,
    TOKENS_PER_SECOND_METRIC,
)

TRAINER_PHASES = (
    "data",
    "encoder",
    "encoder_wait",
    "llm",
    "pipeline_wait",
    "peer_wait",
    "sync",
    "checkpoint_blocking",
)
"""Where a trainer step's time goes (``PhaseTimer`` spans; ``llm`` is what no span covers;
``peer_wait``: waiting for the slowest rank at the step's arrival barriers)."""
PHASES = (*TRAINER_PHASES, "loader_snapshot")
"""Step-time phases: the trainer's via :meth:`record_step` (all but the checkpoint blocking),
the checkpoint blocking and loader snapshot via :meth:`TrainerMetrics.record_checkpoint`. A fixed
set keeps label cardinality bounded; an unknown phase is a programming error."""
DEFAULT_PORT = 9464
"""The trainer pod's container port named ``metrics`` (dockerfiles/trainer.Dockerfile EXPOSEs it,
the chart's PodMonitor scrapes the port by that name)."""
RESTART_ENV = "OMNI_RESTART_ATTEMPT"
"""Set by the operator on every pod of a restarted job (0 for the first attempt)."""

_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
_JOB_LABELS = ("training_job",)
_RANK_LABELS = ("training_job", "rank", "stage")


class MetricsSink(Protocol):
    """What the training loop calls; :class:`TrainerMetrics` and :class:`NullTrainerMetrics`."""

    def serve(self, port: int = 0, *, addr: str = "0.0.0.0") -> int: ...

    def record_step(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        tokens_per_s: float,
        mfu: float,
        step_seconds: float,
        phases: Mapping[str, float],
        samples: Mapping[str, int],
        mixture: Mapping[str, float],
        encoder_activation_peak_bytes: int,
        media_bytes_read: int,
    ) -> None: ...

    def record_skipped(self, counts: Mapping[str, int]) -> None: ...

    def record_checkpoint(
        self,
        *,
        step: int,
        seconds: float,
        blocking_seconds: float,
        age: float = 0.0,
        loader_snapshot_seconds: float = 0.0,
    ) -> None: ...

    def record_checkpoint_skipped(self, step: int) -> None: ...

    def record_resume(self, step: int) -> None: ...

    def record_node_busy(self, busy: Mapping[int, float]) -> None: ...

    def close(self) -> None: ...


def restart_attempt_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The restart attempt the operator stamped on this pod (``OMNI_RESTART_ATTEMPT``), else 0."""
    raw = (os.environ if environ is None else environ).get(RESTART_ENV, "0").strip() or "0"
    try:
        return max(0, int(raw))
    except ValueError as err:
        raise ValueError(f"{RESTART_ENV} must be a non-negative integer, got {raw!r}") from err


class MetricsEndpoint:
    """A private Prometheus registry served over HTTP (shared by the trainer and the operator)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, port: int = 0, *, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` in a daemon thread; ``port=0`` picks a free port.

        Returns:
            The port actually bound (what the pod's PodMonitor or a test scrapes).
        """
        if self._server is not None:
            raise RuntimeError("metrics endpoint already serving")
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (idempotent); the registry keeps its values."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class TrainerMetrics(MetricsEndpoint):
    """Prometheus metrics of one trainer rank, served over HTTP by :meth:`serve`.

    Args:
        job: the OmniTrainingJob name (label ``training_job`` on every series).
        rank: global rank of this process (label ``rank`` on per-rank series).
        stage: pipeline stage of this rank (label ``stage`` on per-rank series).
        restart_attempt: exported as ``omni_trainer_restart_attempt``; ``None`` reads
            ``OMNI_RESTART_ATTEMPT`` from the environment (default 0).
    """

    def __init__(
        self,
        *,
        job: str,
        rank: int = 0,
        stage: int = 0,
        restart_attempt: int | None = None,
    ) -> None:
        super().__init__()
        self._job = job
        self._rank_labels = {"training_job": job, "rank": str(rank), "stage": str(stage)}
        self._add_step_series()
        self._add_data_series()
        self._add_checkpoint_series()
        attempt = restart_attempt_from_env() if restart_attempt is None else restart_attempt
        self._add_run_series(attempt)
        # Series that exist before the first step, so dashboards and alerts see 0, not "no data".
        self.steps.labels(job)
        self.media_bytes.labels(**self._rank_labels)
        for phase in PHASES:
            self.phase_seconds.labels(**self._rank_labels, phase=phase)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = _JOB_LABELS) -> Gauge:
        return Gauge(METRIC_PREFIX + name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = _JOB_LABELS) -> Counter:
        return Counter(METRIC_PREFIX + name, doc, labels, registry=self.registry)

    def _add_step_series(self) -> None:
        """Progress and speed of the last step, and where this rank's step time goes."""
        gauge, r = self._gauge, self.registry
        self.step = gauge(STEP_METRIC, "Last completed training step (1-based).")
        self.steps = self._counter("steps", "Training steps completed by this process.")
        self.loss = gauge("loss", "Training loss of the last step (global batch mean).")
        self.lr = gauge("learning_rate", "Learning rate used by the last step.")
        self.tokens_per_s = gauge(
            TOKENS_PER_SECOND_METRIC, "Job-wide LLM tokens per second of the last step."
        )
        self.mfu = gauge(
            MFU_METRIC,
            "Model FLOPs utilisation of the last step, 0..1 (Megatron-LM's count: causal "
            "attention halved; encoder FLOPs counted).",
        )
        self.step_seconds = Histogram(
            METRIC_PREFIX + "step_duration_seconds",
            "Wall time of a training step on this rank.",
            _RANK_LABELS,
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.phase_seconds = self._counter(
            "phase_seconds",
            "Seconds this rank spent in each step phase (rate() = share of wall time).",
            (*_RANK_LABELS, "phase"),
        )

    def _add_data_series(self) -> None:
        """What the step trained on: samples and mixture per modality, media read, skips, and
        the encoder activations it held."""
        gauge = self._gauge
        self.samples = self._counter(
            "samples",
            "Samples trained on, per modality.",
            (*_JOB_LABELS, "modality"),
        )
        self.mixture = gauge(
            "mixture_share",
            "Current share of each modality in the data mixture schedule, 0..1.",
            (*_JOB_LABELS, "modality"),
        )
        self.activation_peak = gauge(
            "encoder_activation_peak_bytes",
            "Peak bytes encoder forwards kept for backward during the last step.",
            _RANK_LABELS,
        )
        self.media_bytes = self._counter(
            "media_bytes_read",
            "Bytes of media this rank loaded (only what its encoders encode).",
            _RANK_LABELS,
        )
        self.samples_skipped = self._counter(
            "samples_skipped",
            "Samples this rank's loaders skipped (missing, corrupt, too_long...), by reason.",
            (*_RANK_LABELS, "reason"),
        )

    def _add_checkpoint_series(self) -> None:
        """Checkpoint durations, the latest complete one's step and age, skipped saves."""
        gauge, r = self._gauge, self.registry
        self.checkpoint_seconds = Histogram(
            METRIC_PREFIX + "checkpoint_duration_seconds",
            "Time from checkpoint start to its commit marker (background upload included).",
            _JOB_LABELS,
            buckets=_CHECKPOINT_BUCKETS,
            registry=r,
        )
        self.checkpoint_blocking = Histogram(
            METRIC_PREFIX + "checkpoint_blocking_seconds",
            "Time a checkpoint stopped training (the synchronous part).",
            _JOB_LABELS,
            buckets=_CHECKPOINT_BUCKETS,
            registry=r,
        )
        self.checkpoint_state_time = gauge(
            "checkpoint_last_complete_timestamp_seconds",
            "Unix time of the training state held by the latest complete checkpoint "
            "(time() minus this is the checkpoint age).",
        )
        self.checkpoint_step = gauge(
            CHECKPOINT_STEP_METRIC, "Optimizer steps held by the latest complete checkpoint."
        )
        self.checkpoints_skipped = self._counter(
            "checkpoints_skipped",
            "Checkpoints not taken because the save before them waited on failing storage.",
            _JOB_LABELS,
        )

    def _add_run_series(self, attempt: int) -> None:
        """The run as the operator reads it: restart attempt, resumed step, node busy time."""
        gauge = self._gauge
        self.restart_attempt = gauge(
            ATTEMPT_METRIC, "Restart attempt of this job run (0 = never restarted)."
        )
        self.restart_attempt.labels(self._job).set(attempt)
        self.resumed_from = gauge(
            RESUMED_FROM_METRIC,
            "Checkpoint step this run resumed from (0: from the start); the operator records it "
            "as the restart's fromStep.",
        )
        self.node_busy = gauge(
            NODE_BUSY_METRIC,
            "Per node: median busy seconds per step of its slowest rank over the last steps (the "
            "step minus waits for peers; a straggler's is the longest). Served by global rank 0.",
            (*_JOB_LABELS, "node_rank"),
        )

    # -- recording --------------------------------------------------------------------------
    def record_step(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        tokens_per_s: float,
        mfu: float,
        step_seconds: float,
        phases: Mapping[str, float],
        samples: Mapping[str, int],
        mixture: Mapping[str, float],
        encoder_activation_peak_bytes: int,
        media_bytes_read: int,
    ) -> None:
        """Record one finished step.

        Args:
            step: 1-based number of the step just completed.
            loss, lr, tokens_per_s, mfu: as the run summary reports them (MFU as a ratio).
            step_seconds: wall time of the step on this rank.
            phases: seconds per phase of this step (keys from :data:`PHASES`); counters, so
                ``rate()`` gives each phase's share of wall time however often Prometheus scrapes.
            samples: samples of this step per modality (added to the counters).
            mixture: current mixture share per modality.
            encoder_activation_peak_bytes: this rank's peak during the step.
            media_bytes_read: media this rank loaded during the step (added to the counter;
                the zero-redundancy filter keeps it to the media this rank encodes).
        """
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown step phases {sorted(unknown)}; known: {list(PHASES)}")
        job = self._job
        self.step.labels(job).set(step)
        self.steps.labels(job).inc()
        self.loss.labels(job).set(loss)
        self.lr.labels(job).set(lr)
        self.tokens_per_s.labels(job).set(tokens_per_s)
        self.mfu.labels(job).set(mfu)
        self.step_seconds.labels(**self._rank_labels).observe(step_seconds)
        for phase, seconds in phases.items():
            self.phase_seconds.labels(**self._rank_labels, phase=phase).inc(max(0.0, seconds))
        for modality, count in samples.items():
            self.samples.labels(job, modality).inc(count)
        for modality, share in mixture.items():
            self.mixture.labels(job, modality).set(share)
        self.activation_peak.labels(**self._rank_labels).set(encoder_activation_peak_bytes)
        self.media_bytes.labels(**self._rank_labels).inc(max(0, media_bytes_read))

    def record_skipped(self, counts: Mapping[str, int]) -> None:
        """Add samples skipped since the last call, by reason."""
        for reason, n in counts.items():
            if n > 0:
                self.samples_skipped.labels(**self._rank_labels, reason=reason).inc(n)

    def record_checkpoint(
        self,
        *,
        step: int,
        seconds: float,
        blocking_seconds: float,
        age: float = 0.0,
        loader_snapshot_seconds: float = 0.0,
    ) -> None:
        """Record a checkpoint that just became complete (its commit marker is written).

        Args:
            step: the optimizer steps it holds (the operator's restart budget grows with it).
            seconds: start to commit, background upload included.
            blocking_seconds: the part that stopped training (also a step phase).
            age: seconds between the training state it holds and now (the async upload lag);
                the checkpoint-age panel is ``time() - <state timestamp>``, so it keeps growing
                between checkpoints without anyone calling this method.
            loader_snapshot_seconds: blocking time of capturing the loader state (a step phase).
        """
        job = self._job
        self.checkpoint_step.labels(job).set(step)
        self.checkpoint_seconds.labels(job).observe(seconds)
        self.checkpoint_blocking.labels(job).observe(blocking_seconds)
        self.checkpoint_state_time.labels(job).set(time.time() - age)
        self.phase_seconds.labels(**self._rank_labels, phase="checkpoint_blocking").inc(
            max(0.0, blocking_seconds)
        )
        self.phase_seconds.labels(**self._rank_labels, phase="loader_snapshot").inc(
            max(0.0, loader_snapshot_seconds)
        )

    def record_checkpoint_skipped(self, step: int) -> None:
        """A checkpoint due after ``step`` was skipped: the save before it waits on failing
        storage (training went on; the age panel shows the growing gap)."""
        self.checkpoints_skipped.labels(self._job).inc()

    def record_resume(self, step: int) -> None:
        """This run continued from the checkpoint of ``step`` optimizer steps (0: none)."""
        self.resumed_from.labels(self._job).set(step)

    def record_node_busy(self, busy: Mapping[int, float]) -> None:
        """Every node's window median of busy seconds per step (global rank 0 gathers them)."""
        for node, seconds in busy.items():
            self.node_busy.labels(self._job, str(node)).set(seconds)


class NullTrainerMetrics:
    """For ranks that do not export: same methods as :class:`TrainerMetrics`, no effect."""

    def serve(self, port: int = 0, *, addr: str = "0.0.0.0") -> int:
        return 0

    def record_step(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        tokens_per_s: float,
        mfu: float,
        step_seconds: float,
        phases: Mapping[str, float],
        samples: Mapping[str, int],
        mixture: Mapping[str, float],
        encoder_activation_peak_bytes: int,
        media_bytes_read: int,
    ) -> None:
        pass

    def record_skipped(self, counts: Mapping[str, int]) -> None:
        pass

    def record_checkpoint(
        self,
        *,
        step: int,
        seconds: float,
        blocking_seconds: float,
        age: float = 0.0,
        loader_snapshot_seconds: float = 0.0,
    ) -> None:
        pass

    def record_checkpoint_skipped(self, step: int) -> None:
        pass

    def record_resume(self, step: int) -> None:
        pass

    def record_node_busy(self, busy: Mapping[int, float]) -> None:
        pass

    def close(self) -> None:
        pass
