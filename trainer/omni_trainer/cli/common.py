"""What every ``omni`` command shares: the error console, a failure's exit, the job manifest
argument and loading it, and the checks said before a job runs (warnings, reachable storage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from omni_trainer.config import ManifestError, load_manifest

err_console = Console(stderr=True, soft_wrap=True, highlight=False)

ManifestArg = Annotated[Path, typer.Argument(help="OmniTrainingJob YAML")]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Prints ``message`` as an error; returns the exit to raise."""
    err_console.print("[bold red]error:[/bold red] ", end="")
    err_console.print(message, markup=False)
    return typer.Exit(code)


def load_job(
    path: Path, *, whole: bool = False, local_world_size: int | None = None, defer_hf: bool = False
):
    """The manifest at ``path`` (see :func:`omni_trainer.config.load_manifest`); an invalid one
    exits with its errors."""
    try:
        return load_manifest(
            path, whole=whole, local_world_size=local_world_size, defer_hf=defer_hf
        )
    except ManifestError as err:
        raise fail(str(err)) from None


def warn_manifest(job) -> None:
    """What the manifest lets through but changes the data or the network, said before anything
    runs."""
    from omni_trainer.distributed.layout import manifest_warnings

    for line in [*manifest_warnings(job.spec.trainer), *job.job_warnings]:
        err_console.print("[bold yellow]warning:[/bold yellow] ", end="")
        err_console.print(line, markup=False)


def require_sources(cfg, *, for_export: bool = True) -> None:
    """Data sources and checkpoint storage reachable, or one ManifestError naming each cause
    (``preflight.check_sources``)."""
    from omni_trainer.preflight import check_sources

    found = check_sources(cfg, for_export=for_export)
    for line in found.warnings:
        err_console.print("[bold yellow]warning:[/bold yellow] ", end="")
        err_console.print(line, markup=False)
    if found.problems:
        raise ManifestError("the job's storage:\n" + "\n".join(found.problems))
