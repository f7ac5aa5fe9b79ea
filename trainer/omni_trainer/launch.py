"""Run a training job on this machine: in-process for one rank, under torchrun for several."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from omni_trainer import warm
from omni_trainer.config import JobManifest
from omni_trainer.termination import final_report, report


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_argv(nproc: int) -> list[str]:
    """Command prefix starting ``nproc`` local workers (a script or ``-m module`` follows)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}"]  # fmt: skip


def warm_torchrun_argv(nproc: int, *entry: str) -> list[str]:
    """torchrun (itself a stand-in, :func:`warm.through_zygote`) starting ``nproc`` local
    workers, each a stand-in (:mod:`omni_trainer.warm`) for ``entry``: ``omni`` arguments
    (``"train", MANIFEST, ...``) or ``"--entry=script", FILE, ...``. Under a zygote's
    :data:`warm.SOCKET_ENV` they fork from it; without one each starts cold."""
    return warm.through_zygote([*torchrun_argv(nproc), "-m", "omni_trainer.warm", *entry])


def launch_torchrun(
    manifest_path: Path, *, nproc: int, forwarded: list[str], env: dict[str, str] | None = None
) -> int:
    """Start ``nproc`` local workers; each re-enters ``omni train`` and sees the torchrun env
    (plus ``env``, which this process's own environment never receives). They fork from a
    zygote (the one named in this environment, else one started for the run), so the trainer's
    imports are paid once, not once per process."""
    cmd = warm_torchrun_argv(nproc, "train", str(manifest_path), *forwarded)
    with warm.zygote_for_run() as warm_env:
        return subprocess.call(cmd, env={**os.environ, **warm_env, **(env or {})})


# megatron-core warns on every import about optional kernels that CPU runs never have.
_KNOWN_NOISE = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
)


def silence_known_noise() -> None:
    """Hide megatron-core's import-time warnings about TE / Apex kernels (every ``omni``
    command: they say nothing a CPU run or a run without TE can act on)."""
    for message in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=f".*{message}.*", category=UserWarning)


def compute_threads() -> int:
    """Intra-op threads of this process: ``OMNI_NUM_THREADS`` if set, else the machine's cores
    shared by the processes on it (torchrun's own OMP_NUM_THREADS=1 default would leave all but
    one core idle on a CPU run)."""
    explicit = os.environ.get("OMNI_NUM_THREADS")
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise ValueError(f"OMNI_NUM_THREADS must be a positive integer, got {explicit!r}")
        return int(explicit)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local_world)


def run_worker(
    manifest: JobManifest,
    *,
    steps: int | None,
    summary_path: Path | None,
    resume: bool = False,
    metrics_port: int | None = None,
) -> dict:
    """Train on this rank; rank 0 writes the summary. Returns the summary (all ranks), empty
    when a resumed job had no steps left."""
    import torch
    import torch.distributed as dist

    from omni_trainer.components.graceful_stop import EXIT_STOPPED, GracefulStop
    from omni_trainer.components.metrics import NullTrainerMetrics
    from omni_trainer.components.progress import NullReporter
    from omni_trainer.distributed.layout import layout_for
    from omni_trainer.mcore.parallel import (
        build_process_groups,
        destroy_distributed,
        init_distributed,
    )
    from omni_trainer.trainer import Trainer

    silence_known_noise()
    torch.set_num_threads(compute_threads())
    cfg = manifest.spec.trainer
    rank, world_size, device = init_distributed()
    metrics = NullTrainerMetrics()
    stop = None
    try:
        preflight = _network_preflight(manifest, rank)  # before step 1 of every attempt
        dims = layout_for(cfg, world_size)
        groups = build_process_groups(dims, device, reorder_group_size=cfg.data.reorder.group_size)
        stop = GracefulStop(group=dist.new_group(backend="gloo") if world_size > 1 else None)
        reporter = _reporter(cfg.train.step_log) if rank == 0 else NullReporter()
        metrics = _metrics(job=manifest.metadata.name, rank=rank, port=metrics_port)
        trainer = Trainer(
            cfg,
            groups=groups,
            steps=steps or cfg.train.steps,
            reporter=reporter,
            resume=resume,
            metrics=metrics,
            stop=stop,
        )
        metrics.record_resume(trainer.start_step)
        if trainer.start_step >= trainer.steps:  # killed after its last step: done already
            if rank == 0:
                print(f"nothing left to train: resumed at step {trainer.start_step} of "
                      f"{trainer.steps}", flush=True)  # fmt: skip
                # the operator confirms the restart from this (the metrics endpoint is gone)
                done = {"first_step": trainer.start_step, "steps": 0}
                report(final_report({**done, "last_checkpoint_step": trainer.start_step}))
            return {}
        summary = asdict(trainer.train())
        summary["job"] = manifest.metadata.name
        if preflight is not None:
            summary["preflight"] = asdict(preflight)
        if trainer.checkpointer is not None:  # a collective: every rank asks
            summary["last_checkpoint_step"] = trainer.checkpointer.latest_step()
        if rank == 0 and summary_path is not None:
            summary_path.parent.mkdir(parents=True, exist_ok=True)
            summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        if trainer.stopped_at is not None:  # SIGTERM: the operator reads the code
            raise SystemExit(EXIT_STOPPED)
        return summary
    finally:
        if stop is not None:
            stop.close()
        metrics.close()
        destroy_distributed()


def _network_preflight(manifest: JobManifest, rank: int):
    """``spec.preflight``'s bandwidth check across the gang; a slow or silent node ends the
    process with the code and message the operator classifies as PreflightFailed."""
    from omni_trainer.distributed.netcheck import enforce, node_name, run_preflight
    from omni_trainer.distributed.netcheck_rules import PreflightConfig
    from omni_trainer.pod_protocol import SAME_NODES_ENV

    if os.environ.get(SAME_NODES_ENV) == "1":  # an in-place restart: these nodes passed it
        if rank == 0:
            print("network preflight: skipped, an in-place restart on checked nodes", flush=True)
        return None
    cfg = PreflightConfig.model_validate((manifest.spec.model_extra or {}).get("preflight") or {})
    result = run_preflight(cfg, rank=rank, node=node_name())
    enforce(result)
    return result


def _reporter(step_log: str | None):
    """Rank 0: the console, plus the step log if the manifest asks for one."""
    from omni_trainer.components.metrics import restart_attempt_from_env
    from omni_trainer.components.progress import ConsoleReporter, Reporters, StepLog

    console = ConsoleReporter()
    if step_log is None:
        return console
    return Reporters(console, StepLog(step_log, attempt=restart_attempt_from_env()))


def _metrics(*, job: str, rank: int, port: int | None):
    """The first process of each pod (local rank 0) serves Prometheus metrics on ``port``
    (address ``OMNI_METRICS_ADDR``, default all); ``None`` (the local default) serves nothing."""
    from omni_trainer.components.metrics import NullTrainerMetrics, TrainerMetrics

    if port is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return NullTrainerMetrics()
    from megatron.core import parallel_state as ps

    metrics = TrainerMetrics(job=job, rank=rank, stage=ps.get_pipeline_model_parallel_rank())
    metrics.serve(port, addr=os.environ.get("OMNI_METRICS_ADDR", "0.0.0.0"))
    return metrics
