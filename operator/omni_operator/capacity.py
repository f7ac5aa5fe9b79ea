"""Node capacity: what a pod requests and what each node has left (pure functions).

A node's free capacity is its ``status.allocatable`` minus the requests of every pod that holds
a place on it, in any namespace and of any owner: pods bound to it (``spec.nodeName``) and pods
pinned to it but not bound yet (a required node affinity on ``metadata.name`` naming only it:
what the operator creates), until they end (Succeeded/Failed). A terminating pod still holds its
place, as it does for kube-scheduler. A pod's requests are computed as kube-scheduler does: the
larger of its containers' sum and its largest init container, plus its overhead; a resource
with a limit but no request requests the limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Obj = Mapping[str, Any]
Resources = dict[str, float]

REQUEST_FRACTION = 0.9
"""Default CPU/memory requests: this share of the node's allocatable (one pod per node; the
rest stays for daemons such as device plugins and log shippers)."""
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
ENDED = ("Succeeded", "Failed")


def quantity(value: Any) -> float | None:
    """A Kubernetes quantity (``96``, ``500m``, ``1Ti``, ``64G``) as a number, or None."""
    text = str(value).strip()
    for suffixes in (_BINARY, _DECIMAL):
        for suffix, factor in suffixes.items():
            if text.endswith(suffix):
                text, scale = text[: -len(suffix)], factor
                break
        else:
            continue
        break
    else:
        scale = 1
        if text.endswith("m"):
            text, scale = text[:-1], 1e-3
    try:
        return float(text) * scale
    except ValueError:
        return None


def default_requests(allocatable: Mapping[str, str]) -> dict[str, str]:
    """CPU and memory requests from a node's allocatable (:data:`REQUEST_FRACTION` of it)."""
    out = {}
    cpu = quantity(allocatable.get("cpu", ""))
    if cpu:
        out["cpu"] = f"{int(cpu * 1000 * REQUEST_FRACTION)}m"
    memory = quantity(allocatable.get("memory", ""))
    if memory:
        out["memory"] = f"{int(memory * REQUEST_FRACTION) // 2**20}Mi"
    return out


def resources(values: Mapping[str, Any]) -> Resources:
    """Quantities by resource name as numbers (malformed ones count as 0)."""
    return {k: quantity(v) or 0.0 for k, v in values.items()}


def container_requests(container: Obj) -> Resources:
    """A container's requests; a limit without a request requests the limit."""
    res = container.get("resources") or {}
    out = resources(res.get("limits") or {})
    out.update(resources(res.get("requests") or {}))
    return out


def pod_requests(pod: Obj) -> Resources:
    """What a pod takes of its node (see the module docstring)."""
    spec = pod.get("spec") or {}
    total: Resources = {}
    for c in spec.get("containers") or []:
        for k, v in container_requests(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in spec.get("initContainers") or []:
        for k, v in container_requests(c).items():
            total[k] = max(total.get(k, 0.0), v)
    for k, v in resources(spec.get("overhead") or {}).items():
        total[k] = total.get(k, 0.0) + v
    return total


def held_node(pod: Obj) -> str | None:
    """The node whose capacity the pod holds: bound, else pinned to one node; None when it
    ended or may still go anywhere."""
    if ((pod.get("status") or {}).get("phase") or "") in ENDED:
        return None
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    return pinned_node(pod)


def pinned_node(pod: Obj) -> str | None:
    """The one node a pod may run on: a required node affinity on ``metadata.name`` with a
    single value, or the hostname label in ``nodeSelector``; else None."""
    spec = pod.get("spec") or {}
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in affinity.get("nodeSelectorTerms") or []:
        for expr in term.get("matchFields") or []:
            if expr.get("key") == "metadata.name" and expr.get("operator") == "In":
                values = expr.get("values") or []
                if len(values) == 1:
                    return str(values[0])
    host = (spec.get("nodeSelector") or {}).get("kubernetes.io/hostname")
    return str(host) if host else None


def used(pods: Iterable[Obj]) -> dict[str, Resources]:
    """Requests held per node name by ``pods``."""
    out: dict[str, Resources] = {}
    for pod in pods:
        node = held_node(pod)
        if node is None:
            continue
        held = out.setdefault(node, {})
        for k, v in pod_requests(pod).items():
            held[k] = held.get(k, 0.0) + v
    return out


def free(nodes: Iterable[Obj], pods: Iterable[Obj]) -> dict[str, Resources]:
    """Each node's allocatable minus what ``pods`` hold on it (see the module docstring)."""
    held = used(pods)
    out = {}
    for node in nodes:
        name = node["metadata"]["name"]
        left = resources((node.get("status") or {}).get("allocatable") or {})
        for k, v in held.get(name, {}).items():
            left[k] = left.get(k, 0.0) - v
        out[name] = left
    return out


def shortfall(want: Mapping[str, float], have: Mapping[str, float]) -> str | None:
    """What of ``want`` is missing from ``have`` (``"1 of 2 nvidia.com/gpu free"``), or None
    when everything fits."""
    missing = []
    for k, v in sorted(want.items()):
        left = have.get(k, 0.0)
        if v > 0 and left + 1e-9 < v:
            missing.append(f"{format_amount(k, max(left, 0.0))} of {format_amount(k, v)} {k} free")
    return "; ".join(missing) or None


def format_amount(resource: str, value: float) -> str:
    """``1800m`` for CPU, ``57Gi`` for memory, whole numbers for devices."""
    if resource == "cpu":
        return f"{round(value * 1000)}m" if value != int(value) else str(int(value))
    if resource in ("memory", "ephemeral-storage"):
        return f"{value / 2**30:.3g}Gi"
    return f"{value:g}"
