"""``omni supervise``: a trainer pod's init, which runs the command after ``--`` for the
operator's restart attempt and restarts it in place when the operator names a newer one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from omni_trainer.cli.common import fail

PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
"""The command's context settings: everything after ``--`` is the command it supervises."""


def supervise(
    ctx: typer.Context,
    attempt_file: Annotated[
        Path, typer.Option(help="the file naming the restart attempt to run (from the operator)")
    ],
    state_dir: Annotated[
        Path, typer.Option(help="a directory that outlives the container (an emptyDir)")
    ],
    standby: Annotated[
        bool, typer.Option(help="a hot spare: warm up, then wait until the operator assigns it")
    ] = False,
    warm: Annotated[
        bool,
        typer.Option(
            help="keep a pre-imported trainer the workers fork from (omni_trainer.warm: the "
            "command runs `-m omni_trainer.warm`), so restarts skip the imports"
        ),
    ] = False,
    report_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="report a failed attempt over HTTP on this port (the pod's readinessProbe) and "
            "keep the container; without it, a failure ends the container",
        ),
    ] = None,
) -> None:
    """A trainer pod's init: run the command after `--` for the operator's restart attempt, and
    restart it in place when the operator names a newer one (restartPolicy.mode: in-place)."""
    from omni_trainer.failure_report import FailureReport
    from omni_trainer.pod_protocol import ATTEMPT_ENV
    from omni_trainer.supervisor import Supervisor

    if not ctx.args:
        raise fail("omni supervise needs the command to run after `--`")
    pods = int(os.environ.get(ATTEMPT_ENV, "0"))  # the attempt that created this pod
    report = None
    if report_port is not None:
        try:
            report = FailureReport(report_port, os.environ.get("OMNI_METRICS_ADDR", "0.0.0.0"))
        except OSError as err:
            raise fail(f"omni supervise --report-port={report_port}: {err}") from None
    code = Supervisor(ctx.args, attempt_file=attempt_file, state_dir=state_dir, pods=pods,
                      pod=os.environ.get("POD_NAME"), standby=standby, warm=warm,
                      report=report.start() if report else None).run()  # fmt: skip
    raise typer.Exit(code)
