"""``omni export``: the job's model written as a Hugging Face model, from a checkpoint of any
layout or from the initial weights."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from omni_trainer.cli.common import ManifestArg, err_console, fail, load_job


def export_cmd(
    manifest: ManifestArg,
    out: Annotated[Path, typer.Option(help="new directory for the Hugging Face model")],
    checkpoint: Annotated[
        str | None,
        typer.Option(
            help="a checkpoint root or one step-NNNNNNNN directory (default: the latest "
            "complete checkpoint under checkpoint.path)"
        ),
    ] = None,
    initial_weights: Annotated[
        bool,
        typer.Option(
            "--initial-weights",
            help="with no checkpoint, write the untrained weights the job starts from",
        ),
    ] = False,
) -> None:
    """Write the model as a Hugging Face model (safetensors, config.json, tokenizer files) in
    the family it was imported from (Llama for presets), from a checkpoint of any layout."""
    from omni_trainer.checkpoint.earlier_run import no_checkpoint
    from omni_trainer.interop.export import check_export, write_hf
    from omni_trainer.interop.runtime import resolve_checkpoint, single_process_model

    cfg = load_job(manifest).spec.trainer
    try:
        check_export(cfg, out)  # before any weight is allocated
        if not initial_weights and resolve_checkpoint(cfg, checkpoint) is None:
            raise fail(no_checkpoint(cfg.checkpoint))
        with single_process_model(cfg, checkpoint=checkpoint) as (model, step):
            result = write_hf(model, cfg, out, step=step)
    except (ValueError, OSError) as err:
        raise fail(str(err)) from None
    source = f"checkpoint step {step}" if step is not None else "initial weights"
    typer.echo(
        f"exported {source}: {result.tensors} tensors, {result.bytes / 2**20:,.1f} MiB -> {out} "
        f"({', '.join(result.files)})"
    )
    for part in result.skipped:
        err_console.print(f"note: not exported: {part}", markup=False)
