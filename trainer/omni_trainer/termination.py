"""The trainer's last word in the container's termination message: its fatal error as one line,
or, on success, rank 0's final figures as JSON.

Kubernetes copies the file at ``terminationMessagePath`` (``/dev/termination-log`` by default)
into the pod's ``state.terminated.message``, and the operator copies that into the job's status
and Events: the cause of a failure is then a ``kubectl get`` away instead of line 59 of a log.
A local run (or the sandbox's kubelet) names the file with ``OMNI_TERMINATION_LOG``. Every rank
of a pod shares the file; the first error written wins (the others usually fail because of it:
a peer's broken connection is no cause).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

ENV = "OMNI_TERMINATION_LOG"
DEFAULT_PATH = Path("/dev/termination-log")
LIMIT_BYTES = 4096  # what Kubernetes keeps of a termination message


def termination_log() -> Path | None:
    """Where this process reports its fatal error: ``OMNI_TERMINATION_LOG``, else the
    container's ``/dev/termination-log`` when it exists, else nowhere."""
    explicit = os.environ.get(ENV)
    if explicit:
        return Path(explicit)
    return DEFAULT_PATH if DEFAULT_PATH.exists() else None


def fatal_message(err: BaseException) -> str:
    """``[rank R: ]ExceptionType: message``, the line a human needs, within the size limit."""
    rank = os.environ.get("RANK")
    where = (
        f"rank {rank}: " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    )
    text = f"{where}{type(err).__name__}: {err}".strip()
    data = text.encode()
    if len(data) > LIMIT_BYTES:
        text = data[: LIMIT_BYTES - 3].decode(errors="ignore") + "..."
    return text


@dataclass(frozen=True)
class FinalReport:
    """Rank 0's last word on success: the figures that are final (the operator puts them into
    the job's status once the pods succeeded; its metrics endpoint is gone by then). Written as
    JSON under the keys of :data:`REPORT_KEYS` by :meth:`message`, read back by :meth:`parse`."""

    since_first_step_s: float | None = None
    """How long before the end the attempt's first step finished: the operator costs a restart
    whose attempt ended between two of its progress polls."""
    step: int | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    resumed_from: int | None = None
    checkpoint_step: int | None = None
    preflight: dict[str, Any] | None = None
    """The network check's figures, dropped when they would not fit the message."""

    def message(self) -> str:
        """The report as the termination message: JSON within :data:`LIMIT_BYTES`."""
        report = {REPORT_KEYS[f.name]: getattr(self, f.name) for f in fields(self)}
        text = json.dumps({k: v for k, v in report.items() if v is not None})
        if len(text.encode()) > LIMIT_BYTES:  # a large gang's preflight figures: the rest matters
            return replace(self, preflight=None).message()
        return text

    @classmethod
    def parse(cls, message: str) -> FinalReport | None:
        """The report a termination message holds; None when it holds none (an error line)."""
        try:
            doc = json.loads(message)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        value = {f.name: doc.get(REPORT_KEYS[f.name]) for f in fields(cls)}
        preflight = value["preflight"]
        return cls(
            since_first_step_s=_number(value["since_first_step_s"]),
            step=_whole(value["step"]),
            tokens_per_second=_number(value["tokens_per_second"]),
            mfu=_number(value["mfu"]),
            resumed_from=_whole(value["resumed_from"]),
            checkpoint_step=_whole(value["checkpoint_step"]),
            preflight=preflight if isinstance(preflight, dict) else None,
        )


REPORT_KEYS = {
    "since_first_step_s": "sinceFirstStepSeconds",
    "step": "step",
    "tokens_per_second": "tokensPerSecond",
    "mfu": "mfu",
    "resumed_from": "resumedFrom",
    "checkpoint_step": "checkpointStep",
    "preflight": "preflight",
}
""":class:`FinalReport` field -> its key in the termination message's JSON."""


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _whole(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def final_report(summary: Mapping[str, Any]) -> str:
    """Rank 0's :class:`FinalReport` on success, from its run summary, as the message."""
    first = int(summary.get("first_step") or 0)
    curve, wall = summary.get("step_time_curve") or [], summary.get("wall_time_s")
    return FinalReport(
        since_first_step_s=max(wall - curve[0], 0.0) if curve and wall else None,
        step=first + int(summary["steps"]),
        tokens_per_second=summary.get("tokens_per_second"),
        mfu=summary.get("mfu"),
        resumed_from=first,
        checkpoint_step=summary.get("last_checkpoint_step"),
        preflight=summary.get("preflight"),
    ).message()


def report(message: str) -> None:
    """Write ``message`` to the termination log unless another rank of the pod wrote first
    (the file is locked while it is checked and written). Never raises: the error being reported
    must not be hidden by a failure to report it."""
    path = termination_log()
    if path is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_size == 0:
            os.write(fd, message.encode()[:LIMIT_BYTES])
    except OSError:
        pass
    finally:
        os.close(fd)
