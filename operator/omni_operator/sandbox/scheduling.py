"""The sandbox's kube-scheduler filters for a pod that names no node (pure functions).

An emulation of kube-scheduler's documented contract, the filters the operator's pods use
(``scheduling.placement: scheduler``, a Deployment's pod), not kube-scheduler itself:

* the node is Ready and not cordoned;
* its labels match the pod's ``nodeSelector``; its labels and name match one of the terms of
  its required node affinity (``matchExpressions`` In, NotIn, Exists, DoesNotExist on labels,
  ``matchFields`` on ``metadata.name``; a term's requirements all hold);
* its free capacity (:func:`omni_operator.capacity.free`: allocatable less what the pods bound
  or pinned there request) holds the pod's requests;
* required pod anti-affinity: no pod matching a term's selector runs in the node's domain of the
  term's ``topologyKey``; required pod affinity: one does, or (the first pod of a group) none
  matches anywhere and the pod matches its own term. Pods are those bound and not ended, in the
  pod's namespace.

Scoring is the caller's: :func:`first_fit` takes the first feasible node by name, as the
shared-cluster bench's emulated scheduler does; the sandbox's kubelet prefers the least
allocated.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omni_operator import capacity
from omni_operator.kube_objects import node_not_ready_since

Obj = Mapping[str, Any]
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
HOSTNAME = "kubernetes.io/hostname"


def first_fit(pod: Obj, nodes: Iterable[Obj], pods: Sequence[Obj], now: dt.datetime) -> str | None:
    """The first node by name (n2 before n10) that :func:`feasible` admits, or None."""
    by_name = sorted(nodes, key=lambda n: _natural(n["metadata"]["name"]))
    free = capacity.free(by_name, pods)
    labels = labels_by_node(by_name)
    for node in by_name:
        name = node["metadata"]["name"]
        if feasible(pod, node, pods=pods, free=free[name], labels=labels, now=now):
            return str(name)
    return None


def labels_by_node(nodes: Iterable[Obj]) -> dict[str, Mapping[str, str]]:
    """Each node's labels, its hostname label included (kube-scheduler's topology domains)."""
    out: dict[str, Mapping[str, str]] = {}
    for node in nodes:
        labels = dict(node["metadata"].get("labels") or {})
        labels.setdefault(HOSTNAME, node["metadata"]["name"])
        out[node["metadata"]["name"]] = labels
    return out


def feasible(
    pod: Obj,
    node: Obj,
    *,
    pods: Sequence[Obj],
    free: Mapping[str, float],
    labels: Mapping[str, Mapping[str, str]],
    now: dt.datetime,
) -> bool:
    """Every filter of the module docstring admits ``pod`` on ``node``.

    Args:
        pod: the pod to place (no ``nodeName``).
        node: a Node object.
        pods: the cluster's pods (the bound ones count for the inter-pod terms).
        free: the node's free capacity.
        labels: every node's labels (:func:`labels_by_node`): the domains of the other pods.
        now: the observation time (readiness).
    """
    if node_not_ready_since(node, now) is not None or (node.get("spec") or {}).get("unschedulable"):
        return False
    if capacity.shortfall(capacity.pod_requests(pod), free):
        return False
    return node_matches(pod, node) and pods_allow(pod, node["metadata"]["name"], pods, labels)


def node_matches(pod: Obj, node: Obj) -> bool:
    """The node's labels and name satisfy the pod's ``nodeSelector`` and required node
    affinity."""
    spec = pod.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(REQUIRED) or {}
    terms = required.get("nodeSelectorTerms") or []
    fields = {"metadata.name": node["metadata"]["name"]}
    return not terms or any(
        all(_holds(e, labels) for e in t.get("matchExpressions") or [])
        and all(_holds(e, fields) for e in t.get("matchFields") or [])
        for t in terms
    )


def pods_allow(
    pod: Obj, node: str, pods: Sequence[Obj], labels: Mapping[str, Mapping[str, str]]
) -> bool:
    """The pod's required inter-pod affinity and anti-affinity hold on the node named ``node``
    (``labels``: :func:`labels_by_node`)."""
    affinity = (pod.get("spec") or {}).get("affinity") or {}
    namespace = _namespace(pod)
    placed = [(p, n) for p in pods if (n := _bound(p)) and _namespace(p) == namespace]
    here = labels.get(node) or {HOSTNAME: node}
    own = (pod.get("metadata") or {}).get("labels") or {}

    def domain(n: str, key: str) -> str | None:
        return (labels.get(n) or {HOSTNAME: n}).get(key)

    for term in (affinity.get("podAntiAffinity") or {}).get(REQUIRED) or []:
        key = term["topologyKey"]
        value = here.get(key)
        if value is not None and any(_selects(term, p) and domain(n, key) == value
                                     for p, n in placed):  # fmt: skip
            return False
    for term in (affinity.get("podAffinity") or {}).get(REQUIRED) or []:
        key = term["topologyKey"]
        matching = [n for p, n in placed if _selects(term, p)]
        if not matching:
            if not _matches(term.get("labelSelector") or {}, own):
                return False
            continue  # the first pod of its group may go anywhere
        value = here.get(key)
        if value is None or not any(domain(n, key) == value for n in matching):
            return False
    return True


def _bound(pod: Obj) -> str | None:
    if ((pod.get("status") or {}).get("phase") or "") in capacity.ENDED:
        return None
    name = (pod.get("spec") or {}).get("nodeName")
    return str(name) if name else None


def _namespace(pod: Obj) -> str:
    return (pod.get("metadata") or {}).get("namespace") or "default"


def _selects(term: Obj, pod: Obj) -> bool:
    return _matches(
        term.get("labelSelector") or {}, (pod.get("metadata") or {}).get("labels") or {}
    )


def _matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    """A label selector (``matchLabels`` and ``matchExpressions``) matches ``labels``."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(_holds(e, labels) for e in selector.get("matchExpressions") or [])


def _holds(expr: Obj, values: Mapping[str, str]) -> bool:
    op, key, want = expr.get("operator"), expr.get("key"), expr.get("values") or []
    if op == "In":
        return values.get(key) in want
    if op == "NotIn":
        return values.get(key) not in want
    if op == "Exists":
        return key in values
    if op == "DoesNotExist":
        return key not in values
    return False


def _natural(s: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s))
