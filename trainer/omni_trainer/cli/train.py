"""``omni train``: the manifest's job on this machine, torchrun started when ``--nproc`` asks
for it; a fatal error also goes to the container's termination message."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from omni_trainer.cli.common import ManifestArg, fail, require_sources, warn_manifest
from omni_trainer.config import ManifestError, load_manifest

if TYPE_CHECKING:
    from omni_trainer.checkpoint.config import CheckpointConfig

SOURCES_CHECKED = "OMNI_SOURCES_CHECKED"
"""Set for the local workers of a launch whose storage the launcher already checked."""


def train(
    manifest: ManifestArg,
    steps: Annotated[
        int | None, typer.Option(min=1, help="override spec.trainer.train.steps")
    ] = None,
    nproc: Annotated[int, typer.Option(min=1, help="local processes (one per GPU on GPUs)")] = 1,
    summary: Annotated[Path | None, typer.Option(help="write a JSON summary here")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            envvar="OMNI_RESUME",
            help="auto: continue from the latest complete checkpoint (if any); none: start "
            "fresh, over an earlier run's checkpoints; unset, a run whose checkpoint.path "
            "holds an earlier run's checkpoints stops and asks which",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="OMNI_METRICS_PORT",
            help="serve Prometheus metrics on this port (first process of the machine)",
        ),
    ] = None,
) -> None:
    """Train the manifest's job on this machine (torchrun: gloo on CPU, NCCL on GPUs)."""
    from omni_trainer.launch import inside_torchrun, launch_torchrun, run_worker

    if resume not in ("auto", "none", None):
        raise fail(f"--resume must be 'auto' or 'none', not {resume!r}")
    # Every rank of torchrun re-enters here: the manifest is checked at the world it runs in,
    # and before torchrun starts at --nproc, so a bad manifest is reported once.
    world = int(os.environ["WORLD_SIZE"]) if inside_torchrun() else nproc
    with _fatal_to_termination_log():
        job = load_manifest(manifest, whole=True, local_world_size=world)
        if not inside_torchrun():
            warn_manifest(job)
        # Once per machine (a pod, or this launcher), before the process group forms.
        if os.environ.get("LOCAL_RANK", "0") == "0" and not os.environ.get(SOURCES_CHECKED):
            require_sources(job.spec.trainer, for_export=False)
        if resume is None and not inside_torchrun():  # pods and workers always say which
            _refuse_overwrite(job.spec.trainer.checkpoint)
        if nproc > 1 and not inside_torchrun():
            forwarded = [
                *(["--steps", str(steps)] if steps else []),
                *(["--summary", str(summary)] if summary else []),
                "--resume",
                resume or "none",
            ]
            checked = {SOURCES_CHECKED: "1"}  # the local workers need not check again
            raise typer.Exit(
                launch_torchrun(manifest, nproc=nproc, forwarded=forwarded, env=checked)
            )
        result = run_worker(
            job,
            steps=steps,
            summary_path=summary,
            resume=resume == "auto",
            metrics_port=metrics_port,
        )
    if result and _is_rank0():
        from omni_trainer.termination import final_report, report

        report(final_report(result))
        _print_summary(result)


def _refuse_overwrite(cfg: CheckpointConfig | None) -> None:
    """A fresh local run stops before it overwrites an earlier run's checkpoints."""
    from omni_trainer.checkpoint.earlier_run import earlier_run

    problem = earlier_run(cfg)
    if problem is not None:
        raise ManifestError(problem)


@contextlib.contextmanager
def _fatal_to_termination_log() -> Iterator[None]:
    """A fatal error of ``omni train`` also goes to the container's termination message, which
    the operator puts into the job's status (``omni_trainer.termination``)."""
    from omni_trainer.termination import fatal_message, report

    try:
        yield
    except typer.Exit:  # torchrun's exit status: its workers reported for themselves
        raise
    except ManifestError as err:
        report(str(err))
        raise fail(str(err)) from None
    except Exception as err:
        report(fatal_message(err))
        raise


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _print_summary(s: dict) -> None:
    table = Table(title=f"summary: {s['job']}", show_header=False)
    rows = [
        (
            "steps",
            f"{s['steps']}" + (f" (resumed at {s['first_step']})" if s["first_step"] else ""),
        ),
        ("loss", f"{s['initial_loss']:.4f} -> {s['final_loss']:.4f}"),
        ("tokens/s", f"{s['tokens_per_second']:,.0f}"),
        (
            "MFU",
            f"{s['mfu']:.2%} of {s['peak_flops'] / 1e9:,.1f} GFLOP/s ({s['peak_flops_source']})",
        ),
        ("layout", f"{s['layout']['name']} (world {s['world_size']})"),
        ("samples", ", ".join(f"{k} {v}" for k, v in s["samples_per_modality"].items())),
        ("skipped", ", ".join(f"{k} {v}" for k, v in s.get("skipped_samples", {}).items()) or "0"),
        ("wall time", f"{s['wall_time_s']:.1f} s ({s['mean_step_time_s'] * 1e3:.0f} ms/step)"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
