"""The training loop: ``train()`` -> ``train_step()`` -> the step runner, read top-down.

Each component is built by its own builder from its section of the manifest, as torchtitan
does: the model and its parallelisation (``components/model_parts.py``: ``model``,
``parallelism``, ``train.precision`` / ``recompute``), the optimizer (``optimizer``,
``lrSchedule``), the data plane (``data``), the checkpoints (``components/checkpoint_session.py``:
``checkpoint``), the metrics and the summary (``components/run_summary.py``). The megatron
schedule and the encoder anchor are glued together by ``components/step_runner.py``.
"""

from __future__ import annotations

import time

from omni_trainer.checkpoint.state import ModelState
from omni_trainer.components.checkpoint_session import CheckpointSession
from omni_trainer.components.dataplane import DataPlane
from omni_trainer.components.graceful_stop import GracefulStop, NullStop, StopDecision
from omni_trainer.components.metrics import MetricsSink, NullTrainerMetrics
from omni_trainer.components.model_parts import build_model_parts
from omni_trainer.components.optim import check_finite, lr_at
from omni_trainer.components.progress import NullReporter, StepReporter
from omni_trainer.components.run_summary import (
    RunSummary,
    StepResult,
    global_work,
    samples_per_modality,
    summarize,
)
from omni_trainer.components.step_runner import StepRunner
from omni_trainer.components.stragglers import BusyTracker, busy_seconds, node_rank_from_env
from omni_trainer.components.throughput import resolve_peak_flops
from omni_trainer.components.timing import PhaseTimer
from omni_trainer.config import TrainerConfig
from omni_trainer.costs.flops import mfu
from omni_trainer.costs.model_flops import step_flops
from omni_trainer.distributed.layout import check_layout
from omni_trainer.mcore.parallel import ProcessGroups, seed_everything


class Trainer:
    """Multiplexed training of the encoder + LLM model on one rank (any layout, one process
    included)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        groups: ProcessGroups,
        steps: int,
        reporter: StepReporter | None = None,
        resume: bool = False,
        metrics: MetricsSink | None = None,
        stop: GracefulStop | NullStop | None = None,
    ) -> None:
        dims = groups.dims
        check_layout(cfg, dims)
        self.cfg, self.groups, self.steps = cfg, groups, steps
        self.reporter = reporter or NullReporter()
        self.metrics = metrics or NullTrainerMetrics()
        self.stop = stop or NullStop()
        seed_everything(cfg.seed)
        self.parts = build_model_parts(cfg, groups)
        self.optimizer = self.parts.build_optimizer(cfg.optimizer)
        self.timer = PhaseTimer(events=groups.device.type == "cuda")
        self.data = DataPlane(
            cfg,
            dp_rank=groups.dp_rank,
            dp_size=dims.dp,
            group=groups.reorder,
            read_ahead=dims.pp == 1,  # then this rank encodes all the media it draws
        )
        self.runner = StepRunner(
            cfg, groups=groups, parts=self.parts, data=self.data, timer=self.timer
        )
        self.checkpoints = CheckpointSession(
            cfg.checkpoint,
            groups=groups,
            state=lambda: ModelState.from_trainer(self),
            data=self.data,
            timer=self.timer,
            metrics=self.metrics,
        )
        self.start_step = self.checkpoints.start(resume=resume)
        self.busy = BusyTracker(node_rank=node_rank_from_env(groups.rank), group=groups.world)
        self.stopped_at: int | None = None
        """The step a SIGTERM stopped the run at (None: it was not stopped)."""
        self.reorder_bytes: list[int] = []
        self._skipped_exported: dict[str, int] = {}
        self.peak_flops, self.peak_source = resolve_peak_flops(
            groups.device,
            dtype=self.parts.dtype,
            world_size=dims.world_size,
            override_per_device=cfg.train.peak_flops_per_device,
        )

    # what ModelState.from_trainer and the tests read of a trainer
    @property
    def model(self):
        return self.parts.model

    @property
    def chunks(self) -> list:
        return self.parts.chunks

    @property
    def main(self):
        return self.parts.main

    @property
    def encoder_zero(self):
        return self.parts.encoder_zero

    @property
    def checkpointer(self):
        return self.checkpoints.checkpointer

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> RunSummary:
        dims = self.groups.dims
        shared = ""
        if self.runner.shared_cores:
            shared = " (stages share CPU cores: front-loaded where it fits)"
        self.reporter.start(
            self.steps,
            f"{self.steps} steps, layout {dims.describe()} (world {dims.world_size}), "
            f"encoder policy {self.cfg.parallelism.encoder.policy}{shared}",
        )
        results: list[StepResult] = []
        t0 = time.perf_counter()
        try:
            for step in range(self.start_step, self.steps):
                r = self.train_step(step)
                results.append(r)
                self._export(r)
                nodes = self.busy.observe(step + 1, busy_seconds(r.seconds, r.phases))
                if nodes is not None and self.groups.rank == 0:
                    self.metrics.record_node_busy(nodes)
                self.checkpoints.poll()
                self.reporter.update(
                    step + 1,
                    loss=r.loss,
                    tokens_per_s=r.tokens / r.seconds,
                    mfu=mfu(r.flops / r.seconds, self.peak_flops),
                    fingerprint=r.fingerprint,
                )
                decision = self.stop.decide(save_estimate_s=self.checkpoints.save_seconds)
                if decision is not None:
                    self._stop(step + 1, decision)
                    break
            else:
                self.checkpoints.finish(self.steps)
        finally:
            self.reporter.close()
            self.data.close()
            self.checkpoints.close()
        return self.summary(results, wall=time.perf_counter() - t0)

    def _stop(self, step: int, decision: StopDecision) -> None:
        """SIGTERM: checkpoint ``step`` unless it is saved already or the grace is too short
        (the ``finally`` of :meth:`train` waits for the save)."""
        self.stopped_at = step
        save = (
            self.checkpointer is not None
            and self.checkpoints.saved_step != step
            and decision.can_save
        )
        if save:
            self.checkpoints.save(step)
        if self.groups.rank == 0:
            what = "writing an emergency checkpoint" if save else "no checkpoint written"
            print(f"stopping after step {step} on SIGTERM ({decision.grace_left_s:.0f} s of grace "
                  f"left): {what}", flush=True)  # fmt: skip

    def train_step(self, step: int) -> StepResult:
        start = time.perf_counter()
        media_bytes = self.data.media.bytes_read
        self.runner.arrive()  # after the previous step's checkpoint and loop work
        with self.timer.span("data"):
            local = self.data.next_local_batch()
            flops = step_flops(self.cfg.model, local)
            tokens, training_flops, fingerprint = global_work(flops, local, group=self.groups.dp)
            if self.data.last_stats is not None:
                self.reorder_bytes.append(self.data.last_stats.bytes_moved)
        lr = lr_at(step, opt=self.cfg.optimizer, sched=self.cfg.lr_schedule, total_steps=self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_multiplier"]
        self.parts.zero_grad()  # at the start: gradients stay inspectable after the step
        loss = self.runner.forward_backward(local)
        with self.timer.span("sync"):
            grad_norm = self.parts.clip(self.cfg.optimizer.clip_grad)
            # before the update, on every rank
            check_finite(step + 1, loss, grad_norm, resumed_from=self.start_step or None)
            self.optimizer.step()
        self.runner.arrive()  # after the optimizer, before the parameters' all-gather
        with self.timer.span("sync"):
            self.parts.sync_parameters()
        if self.checkpoints.due(step + 1):
            self.checkpoints.save(step + 1, periodic=True)
        seconds = time.perf_counter() - start
        encoder_peak = self.runner.anchor.memory.take_peak()
        phases = self.timer.take()
        op_log = [(name, a - start, b - start) for name, a, b in self.timer.take_log()]
        # What no span covers is the LLM's own forward/backward compute (and Python overhead).
        phases["llm"] = max(seconds - sum(phases.values()), 0.0)
        return StepResult(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            seconds=seconds,
            tokens=tokens,
            flops=training_flops,
            fingerprint=fingerprint,
            samples=samples_per_modality(local),
            phases=phases,
            encoder_activation_peak_bytes=encoder_peak,
            # the encoders' saved tensors are counted by their own meter (inner hooks win)
            activation_peak_bytes=self.runner.activations.take_peak() + encoder_peak,
            media_bytes_read=self.data.media.bytes_read - media_bytes,
            op_log=op_log,
        )

    # -- results ----------------------------------------------------------------------------
    def _export(self, r: StepResult) -> None:
        """Prometheus figures of a finished step (the same ones the summary is built from)."""
        stream = self.data.streams[0]
        self.metrics.record_step(
            step=r.step + 1,
            loss=r.loss,
            lr=r.lr,
            tokens_per_s=r.tokens / r.seconds,
            mfu=mfu(r.flops / r.seconds, self.peak_flops),
            step_seconds=r.seconds,
            phases={k: v for k, v in r.phases.items() if k != "checkpoint_blocking"},
            samples=r.samples,
            mixture=stream.mixer.schedule.weights(stream.mixer.total),
            encoder_activation_peak_bytes=r.encoder_activation_peak_bytes,
            media_bytes_read=r.media_bytes_read,
        )
        if self.groups.tp_rank == self.groups.cp_rank == self.groups.anchor.stage == 0:
            skipped = self.data.counters["skipped_samples"]
            self.metrics.record_skipped(
                {k: v - self._skipped_exported.get(k, 0) for k, v in skipped.items()}
            )
            self._skipped_exported = skipped

    def summary(self, results: list[StepResult], *, wall: float) -> RunSummary:
        """The run's summary from its step results (a collective: every rank calls it)."""
        return summarize(
            results,
            wall=wall,
            cfg=self.cfg,
            groups=self.groups,
            parts=self.parts,
            optimizer=self.optimizer,
            data=self.data,
            peak=(self.peak_flops, self.peak_source),
            first_step=self.start_step,
            reorder_bytes=self.reorder_bytes,
        )
