"""The trainer's last word: its fatal error, as one line, in the container's termination message.

Kubernetes copies the file at ``terminationMessagePath`` (``/dev/termination-log`` by default)
into the pod's ``state.terminated.message``, and the operator copies that into the job's status
and Events: the cause of a failure is then a ``kubectl get`` away instead of line 59 of a log.
A local run (or the sandbox's kubelet) names the file with ``OMNI_TERMINATION_LOG``. Every rank
of a pod shares the file; the first error written wins (the others usually fail because of it:
a peer's broken connection is no cause).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

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


def report_fatal(message: str) -> None:
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
