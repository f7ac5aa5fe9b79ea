"""The operator's ``omni`` subcommands (registered through the ``omni.commands`` entry point)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the operator's commands to ``omni``."""
    del app  # commands arrive with the operator issue
