"""A running sandbox, from another process: its state file and the fault annotations its
kubelet acts on.

The standard library only: ``omni sandbox fault`` patches one annotation, and on a busy machine
importing the sandbox itself (kopf, the emulator, the kubelet) took 20-50 s, long enough for a
short job to end before its fault landed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STATE_FILE = "sandbox.json"
"""Written by ``omni sandbox up`` in its ``--dir`` while it runs: API server URL, kubeconfig,
nodes."""
FAULT = "sandbox.omni.megascale.io/fault"
"""The Node or Pod annotation the sandbox's kubelet acts on within a tick."""
FAULTS: dict[str, tuple[str, str | None]] = {
    "node-lost": ("node", "lost"),
    "node-ready": ("node", "ready"),
    "degrade-network": ("node", "degraded-network"),
    "kill-pod": ("pod", "kill"),
    "crash-pod": ("pod", "crash"),
    "hang-pod": ("pod", "hang"),
    "throttle-pod": ("pod", "throttle"),
    "unthrottle-pod": ("pod", None),
}
"""``omni sandbox fault`` name -> (object kind, annotation value; None removes it)."""


def read_state(workdir: Path) -> dict[str, Any]:
    """The running sandbox's state file, or a clear error."""
    path = workdir / STATE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeError(
            f"no sandbox is running with --dir {workdir} (no {path}); start one with "
            "`omni sandbox up`"
        ) from None


def inject_fault(
    server: str, fault: str, target: str, *, namespace: str = "default", timeout: float = 30
) -> str:
    """Annotate the node or pod ``target`` with ``fault`` (a key of :data:`FAULTS`); the line
    that says what was set."""
    kind, value = FAULTS[fault]
    path = (
        f"/api/v1/nodes/{target}"
        if kind == "node"
        else f"/api/v1/namespaces/{namespace}/pods/{target}"
    )
    body = json.dumps({"metadata": {"annotations": {FAULT: value}}}).encode()
    request = urllib.request.Request(
        server + path,
        data=body,
        method="PATCH",
        headers={"Content-Type": "application/merge-patch+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            pass
    except urllib.error.HTTPError as err:
        if err.code == 404:
            where = "" if kind == "node" else f" in namespace {namespace}"
            raise RuntimeError(f"{kind} {target!r} not found{where}") from None
        detail = err.read().decode(errors="replace")
        raise RuntimeError(f"{fault} {target}: {err.code} {detail}") from None
    except urllib.error.URLError as err:
        raise RuntimeError(f"{fault} {target}: the sandbox at {server}: {err.reason}") from None
    return f"{kind} {target}: {FAULT}={value}" if value else f"{kind} {target}: {FAULT} removed"
