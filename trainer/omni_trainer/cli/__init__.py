"""``omni``: the command line. It takes run-time choices only; job settings live in the manifest.

This package holds the typer app and registers every command on it, one module per command
group (:mod:`.validate`, :mod:`.train`, :mod:`.plan` with :mod:`.tune`, :mod:`.export`,
:mod:`.generate`, :mod:`.supervise`, :mod:`.data`), all on the helpers of :mod:`.common`.
Commands of other installed parts (the operator's ``render``, ``operator``, ``sandbox``) join
through the ``omni.commands`` entry point group, so the trainer never imports them itself.
``python -m omni_trainer.cli`` and the ``omni`` console script run :data:`app`.
"""

from __future__ import annotations

import typer

from omni_trainer.cli import data, export, generate, plan, supervise, train, validate
from omni_trainer.cli.common import err_console
from omni_trainer.launch import silence_known_noise

app = typer.Typer(
    help="MegaScale-Omni: multimodal LLM training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(validate.validate)
app.command()(train.train)
app.command()(plan.plan)
app.command("export")(export.export_cmd)
app.command()(generate.generate)
app.command(context_settings=supervise.PASSTHROUGH)(supervise.supervise)
app.add_typer(data.data_app, name="data")


def _register_plugins() -> None:
    """Commands of other installed parts (e.g. the operator's ``omni render``), found through the
    ``omni.commands`` entry point group so that the trainer never imports them itself."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="omni.commands"):
        try:
            register = ep.load()
        except ImportError as err:  # an optional part whose extra is not installed
            err_console.print(f"note: {ep.name} commands unavailable ({err})", markup=False)
            continue
        register(app)


_register_plugins()
silence_known_noise()  # before any command imports megatron-core
