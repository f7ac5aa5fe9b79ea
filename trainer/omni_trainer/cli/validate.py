"""``omni validate``: the whole manifest checked as the operator checks it, nothing started."""

from __future__ import annotations

from typing import Annotated

import typer

from omni_trainer.cli.common import (
    ManifestArg,
    err_console,
    fail,
    load_job,
    require_sources,
    warn_manifest,
)
from omni_trainer.config import ManifestError


def validate(
    manifest: ManifestArg,
    nproc: Annotated[
        int | None,
        typer.Option(
            min=1, help="check a local run on this many processes (default: the cluster fields)"
        ),
    ] = None,
    sources: Annotated[
        bool,
        typer.Option(
            "--sources",
            help="also open every data source and the checkpoint storage, with this "
            "machine's credentials",
        ),
    ] = False,
) -> None:
    """Check a whole manifest without starting anything (the operator's checks, cluster fields
    included); every problem is listed with its field path and the fix."""
    # Without --sources nothing is opened, the HF model either (as the operator cannot).
    job = load_job(manifest, whole=True, local_world_size=nproc, defer_hf=not sources)
    cfg = job.spec.trainer
    warn_manifest(job)
    for field, part in cfg.model.unread_hf():
        err_console.print("[bold yellow]note:[/bold yellow] ", end="")
        err_console.print(
            f"spec.trainer.model.{field}.hf ({part.hf}) was not read: the checks that need "
            "its dimensions run with --sources, and in every pod before training",
            markup=False,
        )
    if sources:
        try:
            require_sources(cfg)
        except ManifestError as err:
            raise fail(f"{manifest}: {err}") from None
    where = f"--nproc {nproc}" if nproc else "its cluster fields"
    typer.echo(
        f"{manifest}: valid OmniTrainingJob {job.metadata.name!r} on {where} "
        f"(modalities: {', '.join(cfg.model.modalities)}; "
        f"{len(cfg.data.sources)} sources; {cfg.train.steps} steps)"
    )
