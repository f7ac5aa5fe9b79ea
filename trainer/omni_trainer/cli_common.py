"""What every ``omni`` command group shares: the error console, a failure's exit, the job
manifest argument and loading it."""

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
