"""A pod's running container: the process group a runtime started, and the signals it sends
that group (a container's cgroup: every process of the pod, found by an environment marker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from omni_operator.sandbox import degrade
from omni_operator.sandbox.probes import ReadinessProbe

POD_MARKER = "OMNI_SANDBOX_POD_UID"
"""Set in every pod process's environment: descendants inherit it, so a pod's processes are
found even after torchrun's workers lost their parent (what a container's cgroup gives)."""
THROTTLE_PERIOD_S = 0.1
"""Short beside a step, so the stops land in every phase of it (a period near the step time
would stop the same phase of every step)."""
THROTTLE_STOPPED = 0.5
"""The share of each period a throttled pod's processes are stopped (a node about 2x slower)."""
log = logging.getLogger("omni.sandbox")


@dataclass
class Container:
    """A pod's running process group."""

    pod: str  # "<namespace>/<name>"
    uid: str
    node: str
    name: str  # the container's, as the pod spec names it
    proc: subprocess.Popen[bytes]
    log_path: Path
    grace_s: float
    hung: bool = False
    throttle: asyncio.Task[None] | None = None
    """The duty cycle of a ``throttle`` fault (None: not throttled)."""
    lost: bool = False
    """Its node was lost: it is killed and nobody reports its end."""
    killing_since: float | None = None
    termination_log: Path | None = None
    """The file standing for its ``terminationMessagePath`` (``OMNI_TERMINATION_LOG``)."""
    message_policy: str = "File"
    """``terminationMessagePolicy``: ``FallbackToLogsOnError`` reports the log's tail when the
    file is empty and the container failed."""
    restart_policy: str = "Never"
    restarts: int = 0
    """``restartCount`` of the container this process group runs."""
    mounts: dict[str, Path] = field(default_factory=dict)
    synced_at: float = 0.0
    """When the kubelet last synced its pod's projected volumes (loop time)."""
    synced_meta: str = ""
    """The pod's labels and annotations then (:func:`downward.metadata_version`)."""
    readiness: ReadinessProbe | None = None


def termination_message(c: Container, exit_code: int) -> str | None:
    """What a kubelet reports as ``state.terminated.message``: the termination file (up to 4096
    bytes), else with ``FallbackToLogsOnError`` and a failure the log's last 80 lines (up to
    2048 bytes)."""
    text = ""
    if c.termination_log is not None and c.termination_log.exists():
        text = c.termination_log.read_bytes()[:4096].decode(errors="replace").strip()
    if not text and exit_code != 0 and c.message_policy == "FallbackToLogsOnError":
        with contextlib.suppress(OSError):
            tail = c.log_path.read_bytes().splitlines()[-80:]
            text = b"\n".join(tail)[-2048:].decode(errors="replace").strip()
    return text or None


def pod_processes(uid: str) -> list[psutil.Process]:
    """Every live process of the pod with this uid (by the environment marker)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(POD_MARKER) == uid:
                found.append(proc)
    return found


def send_signal(
    c: Container, sig: signal.Signals, *, all_processes: bool = True, spare_first: bool = False
) -> None:
    """Signal the pod's first process, or all of them (the runtime kills the whole cgroup), or
    all but the first (``spare_first``: its init, e.g. the in-pod supervisor, lives on)."""
    procs = pod_processes(c.uid) if all_processes else []
    if spare_first:
        procs = [p for p in procs if p.pid != c.proc.pid]
    elif not all_processes or not procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(c.proc.pid, sig)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def set_throttle(c: Container, *, on: bool) -> None:
    """Start or stop the duty cycle of a throttled pod (stopping it continues its processes)."""
    if on and c.throttle is None:
        stop_s = THROTTLE_PERIOD_S * THROTTLE_STOPPED

        def processes() -> list[psutil.Process]:  # every process but the pod's first
            return [p for p in pod_processes(c.uid) if p.pid != c.proc.pid]

        c.throttle = asyncio.get_running_loop().create_task(
            degrade.throttle(processes, stop_s=stop_s, run_s=THROTTLE_PERIOD_S - stop_s),
            name=f"sandbox-throttle-{c.pod}",
        )
        log.warning(f"sandbox: {c.pod} throttled ({THROTTLE_STOPPED:.0%} of the time stopped)")
    elif not on and c.throttle is not None:
        c.throttle.cancel()
        c.throttle = None
        send_signal(c, signal.SIGCONT, spare_first=True)
