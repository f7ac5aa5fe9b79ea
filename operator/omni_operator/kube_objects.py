"""Reading the cluster's objects: where a pod runs and at which node rank, since when a Node is
not Ready, how long a container waits in the kubelet's back-off.

Pure accessors over the API's objects as plain mappings, shared by failure classification, restart
decisions, spares, the reconcile and the handlers.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from typing import Any

from omni_operator.render import ANNOTATION_NODE, LABEL_RANK
from omni_operator.times import parse_time

Obj = Mapping[str, Any]


def pod_node(pod: Obj, placement: Sequence[str] = ()) -> str | None:
    """The node a pod runs on: scheduled (``spec.nodeName``), else where it was placed."""
    name = (pod.get("spec") or {}).get("nodeName")
    if name:
        return str(name)
    meta = pod.get("metadata") or {}
    placed = (meta.get("annotations") or {}).get(ANNOTATION_NODE)
    if placed:
        return str(placed)
    rank = pod_rank(pod)
    return placement[rank] if rank is not None and rank < len(placement) else None


def pod_rank(pod: Obj) -> int | None:
    """The pod's node rank label (None: none yet, e.g. a pod the scheduler has not bound)."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK)
    return int(value) if value is not None and str(value).isdigit() else None


def node_not_ready_since(node: Obj, now: dt.datetime) -> dt.datetime | None:
    """When the node stopped being Ready (None: it is Ready). A NotReady/Unknown condition
    without a transition time counts as "since ever": the grace cannot be measured."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") == "True":
        return None
    since = parse_time((ready or {}).get("lastTransitionTime"))
    return since or dt.datetime.min.replace(tzinfo=dt.UTC)


def node_ready_status(node: Obj) -> str:
    """The node's Ready condition in words, for messages (it is not Ready)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None:
        return "without a Ready condition"
    return "unreachable (Ready=Unknown)" if ready.get("status") == "Unknown" else "NotReady"


_BACKOFF = re.compile(r"back-off (\S+) restarting")
_GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


def go_duration_seconds(text: str) -> float | None:
    """A Go ``time.Duration`` as the kubelet prints it (``40s``, ``2m40s``, ``5m0s``)."""
    m = _GO_DURATION.match(text)
    if not text or m is None:
        return None
    h, mins, secs = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mins * 60 + secs


def backoff_left(pod: Obj, now: dt.datetime) -> float:
    """Seconds until the kubelet restarts a container of ``pod`` that waits in
    ``CrashLoopBackOff`` (its back-off counts from the container's end); 0 when none waits."""
    left = 0.0
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        m = _BACKOFF.search(waiting.get("message") or "")
        ended = parse_time(((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
        delay = go_duration_seconds(m.group(1)) if m else None
        if waiting.get("reason") == "CrashLoopBackOff" and delay is not None and ended is not None:
            left = max(left, (ended - now).total_seconds() + delay)
    return left
