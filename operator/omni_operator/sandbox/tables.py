"""Server-side printing for ``kubectl get``: objects as ``meta.k8s.io/v1`` Tables.

kubectl asks the API server for a Table and prints its cells; without one it shows only names
and ages. The columns are the CRD's ``additionalPrinterColumns`` for custom resources and
kubectl's familiar ones for pods, services and nodes. Dates print as ages, like the API server does.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

Obj = dict[str, Any]
Column = dict[str, Any]  # name, type, jsonPath or a cell function, priority


def age(timestamp: str | None, now: dt.datetime | None = None) -> str:
    """An RFC 3339 time (``2026-12-02T15:00:00Z``, with fractions or an offset, as clients
    post them) -> ``42s`` / ``5m3s`` / ``3h`` / ``2d`` (kubectl's style)."""
    if not timestamp:
        return "<unknown>"
    try:
        then = dt.datetime.fromisoformat(timestamp)
    except ValueError:
        return "<invalid>"
    if then.tzinfo is None:
        then = then.replace(tzinfo=dt.UTC)
    s = max(0, int(((now or dt.datetime.now(tz=dt.UTC)) - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 3 * 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def json_path(obj: Obj, path: str) -> Any:
    """The simple ``.a.b.c`` paths printer columns use (None where absent)."""
    cur: Any = obj
    for part in path.strip(".").split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def _pod_status(pod: Obj) -> str:
    """kubectl's STATUS: a container's waiting reason (ContainerCreating, ErrImagePull,
    CrashLoopBackOff) or termination reason wins over the pod's phase."""
    status = pod.get("status") or {}
    meta = pod.get("metadata") or {}
    reason = str(status.get("reason") or status.get("phase") or "Pending")
    running = False
    for cs in reversed(status.get("containerStatuses") or []):
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated")
        if waiting.get("reason"):
            reason = str(waiting["reason"])
        elif terminated is not None:
            code = terminated.get("exitCode", 0)
            reason = str(terminated.get("reason") or f"ExitCode:{code}")
        elif cs.get("ready") and "running" in state:
            running = True
    if reason == "Completed" and running:
        reason = "Running"
    if meta.get("deletionTimestamp"):
        return "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return reason


def _pod_restarts(pod: Obj) -> str:
    """kubectl's RESTARTS: the containers' restarts, and how long ago the last one ended."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    count = sum(int(cs.get("restartCount") or 0) for cs in statuses)
    ends = [
        str(((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt") or "")
        for cs in statuses
    ]
    last = max((e for e in ends if e), default=None)
    return f"{count} ({age(last)} ago)" if count and last else str(count)


def _service_ports(svc: Obj) -> str:
    ports = (svc.get("spec") or {}).get("ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _selector(svc: Obj) -> str:
    selector = (svc.get("spec") or {}).get("selector") or {}
    return ",".join(f"{k}={v}" for k, v in selector.items()) or "<none>"


def _pod_ready(pod: Obj) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or []) or len(statuses)
    return f"{sum(bool(cs.get('ready')) for cs in statuses)}/{total}"


def _node_status(node: Obj) -> str:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            ready = "Ready" if cond.get("status") == "True" else "NotReady"
            unschedulable = (node.get("spec") or {}).get("unschedulable")
            return ready + (",SchedulingDisabled" if unschedulable else "")
    return "Unknown"


def _cell(fn: Callable[[Obj], Any], name: str, *, priority: int = 0) -> Column:
    return {"name": name, "type": "string", "fn": fn, "priority": priority}


def _created_at(o: Obj) -> str | None:
    return (o.get("metadata") or {}).get("creationTimestamp")


def _involved(event: Obj) -> str:
    obj = event.get("involvedObject") or {}
    return f"{str(obj.get('kind', '')).lower()}/{obj.get('name', '')}"


def _created(o: Obj) -> str:
    return age(_created_at(o))


def _deploy_ready(d: Obj) -> str:
    return f"{json_path(d, '.status.readyReplicas') or 0}/{json_path(d, '.spec.replicas') or 0}"


BUILTIN: dict[str, list[Column]] = {
    "Deployment": [
        _cell(_deploy_ready, "Ready"),
        _cell(lambda d: json_path(d, ".status.updatedReplicas") or 0, "Up-to-date"),
        _cell(lambda d: json_path(d, ".status.availableReplicas") or 0, "Available"),
        _cell(_created, "Age"),
    ],
    "Pod": [
        _cell(_pod_ready, "Ready"),
        _cell(_pod_status, "Status"),
        _cell(_pod_restarts, "Restarts"),
        _cell(_created, "Age"),
        _cell(lambda p: json_path(p, ".status.podIP") or "<none>", "IP", priority=1),
        _cell(lambda p: json_path(p, ".spec.nodeName") or "<none>", "Node", priority=1),
    ],
    "Event": [
        _cell(lambda e: age(e.get("lastTimestamp") or _created_at(e)), "Last Seen"),
        _cell(lambda e: e.get("type") or "", "Type"),
        _cell(lambda e: e.get("reason") or "", "Reason"),
        _cell(_involved, "Object"),
        _cell(lambda e: e.get("message") or "", "Message"),
    ],
    "Service": [
        _cell(lambda v: json_path(v, ".spec.type") or "ClusterIP", "Type"),
        _cell(lambda v: json_path(v, ".spec.clusterIP") or "<none>", "Cluster-IP"),
        _cell(lambda v: "<none>", "External-IP"),
        _cell(_service_ports, "Port(s)"),
        _cell(_created, "Age"),
        _cell(_selector, "Selector", priority=1),
    ],
    "Node": [
        _cell(_node_status, "Status"),
        _cell(lambda n: "<none>", "Roles"),
        _cell(_created, "Age"),
        _cell(lambda n: "sandbox", "Version"),
    ],
}


def printer_columns(crd: Obj) -> list[Column]:
    """The served version's ``additionalPrinterColumns`` of a CRD."""
    version = next(v for v in crd["spec"]["versions"] if v.get("served", True))
    return list(version.get("additionalPrinterColumns") or [])


def as_table(
    objs: Sequence[Obj],
    columns: Sequence[Column],
    *,
    resource_version: str,
    include_object: str = "Metadata",
) -> Obj:
    """A ``meta.k8s.io/v1`` Table of ``objs`` (a Name column first); each row carries the
    object as ``includeObject`` asks: ``Metadata`` (the default), ``Object`` (what ``kubectl
    get --sort-by`` sorts on) or ``None``."""
    defs = [{"name": "Name", "type": "string", "format": "name", "description": "",
             "priority": 0}]  # fmt: skip
    for c in columns:
        defs.append({"name": c["name"], "type": "string" if "fn" in c else c.get("type", "string"),
                     "format": "", "description": c.get("description", ""),
                     "priority": c.get("priority", 0)})  # fmt: skip
    rows = []
    for obj in objs:
        cells: list[Any] = [obj["metadata"]["name"]]
        for c in columns:
            if "fn" in c:
                cells.append(c["fn"](obj))
                continue
            value = json_path(obj, c["jsonPath"])
            if c.get("type") == "date":
                value = age(value)
            cells.append(value)
        meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
        row: Obj = {"cells": cells}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": meta}  # fmt: skip
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": defs,
        "rows": rows,
    }
