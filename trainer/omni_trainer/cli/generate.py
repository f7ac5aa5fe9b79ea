"""``omni generate``: greedy decoding with the job's model in one process, media included."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from omni_trainer.cli.common import ManifestArg, fail, load_job


def generate(
    manifest: ManifestArg,
    prompt: Annotated[str, typer.Option(help="one user turn (or the raw text with --raw)")],
    checkpoint: Annotated[
        str | None, typer.Option(help="as for export (default: latest, else initial)")
    ] = None,
    image: Annotated[
        list[Path] | None, typer.Option(help="an image (repeat for several; <image> marks where)")
    ] = None,
    audio: Annotated[
        list[Path] | None, typer.Option(help="an audio clip (repeat; <audio> marks where)")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    raw: Annotated[bool, typer.Option("--raw", help="no chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Greedy decoding with the job's model in one process."""
    import json

    from omni_trainer.interop.generate import generate as run

    cfg = load_job(manifest).spec.trainer
    try:
        result = run(
            cfg,
            prompt,
            checkpoint=checkpoint,
            images=image or [],
            audio=audio or [],
            raw=raw,
            max_new_tokens=max_new_tokens,
        )
    except (ValueError, OSError) as err:
        raise fail(str(err)) from None
    typer.echo(json.dumps(result.as_dict()) if as_json else result.output_text)
