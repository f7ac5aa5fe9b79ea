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


def final_report(summary: Mapping[str, Any]) -> str:
    """Rank 0's last word on success, as JSON: the figures that are final (the operator puts
    them into the job's status once the pods succeeded; its metrics endpoint is gone by then)."""
    first = int(summary.get("first_step") or 0)
    curve, wall = summary.get("step_time_curve") or [], summary.get("wall_time_s")
    report = {
        # how long before the end the attempt's first step finished: the operator costs a
        # restart whose attempt ended between two of its progress polls
        "sinceFirstStepSeconds": max(wall - curve[0], 0.0) if curve and wall else None,
        "step": first + int(summary["steps"]),
        "tokensPerSecond": summary.get("tokens_per_second"),
        "mfu": summary.get("mfu"),
        "resumedFrom": first,
        "checkpointStep": summary.get("last_checkpoint_step"),
        "preflight": summary.get("preflight"),  # the network check's figures (a dict)
    }
    text = json.dumps({k: v for k, v in report.items() if v is not None})
    if len(text.encode()) > LIMIT_BYTES:  # a large gang's preflight figures: the rest matters
        report.pop("preflight")
        text = json.dumps({k: v for k, v in report.items() if v is not None})
    return text


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
