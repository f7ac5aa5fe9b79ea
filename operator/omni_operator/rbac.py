"""The Kubernetes permissions the operator needs: one table for the code, the chart and tests.

``HANDLER_RULES`` is every (apiGroup, resource, verb) the handlers' API client may call; the
client refuses anything else (a test hits that before a cluster answers 403). ``KOPF_RULES`` is
what the kopf framework itself does on our resource. ``ADMISSION_RULES`` is what the API server's
admission checks on the operator's own writes. The chart's RBAC must grant exactly these
(tests/chart/test_chart_rbac.py), and the operator tests check that every handler rule is used.
"""

from __future__ import annotations

from collections.abc import Mapping

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)

_OWNED = ("pods", "services", "configmaps")
HANDLER_RULES: frozenset[Rule] = frozenset(
    {("omni.megascale.io", r, v) for r in ("omnitrainingjobs",) for v in ("get", "list")}
    | {("omni.megascale.io", "omnitrainingjobs/status", "patch")}
    | {("", r, v) for r in _OWNED for v in ("list", "create", "patch", "delete")}
    | {("", "nodes", "list"), ("scheduling.k8s.io", "priorityclasses", "list")}
    | {("scheduling.volcano.sh", "podgroups", v) for v in ("list", "create", "patch", "delete")}
)
"""What ``handlers/kube.py`` may call. Volcano PodGroups only when gang scheduling is on."""

KOPF_RULES: frozenset[Rule] = frozenset(
    {("omni.megascale.io", "omnitrainingjobs", v) for v in ("list", "watch", "patch")}
    | {("", "events", "create")}
    | {("", r, v) for r in ("pods", "nodes") for v in ("list", "watch")}
)
"""kopf: watching the jobs, finalizers/progress annotations (patch), posting Events, and the
pod and Node watches that wake a job's reconcile loop."""

ADMISSION_RULES: frozenset[Rule] = frozenset(
    {("omni.megascale.io", "omnitrainingjobs/finalizers", "update")}
)
"""The owned objects carry ``blockOwnerDeletion``: OwnerReferencesPermissionEnforcement (on by
default in most distributions) refuses their creation (403) unless the creator may update the
owner's finalizers. No request of ours uses it, so the client never checks it."""


def rule_of(method: str, path: str, params: Mapping[str, str] | None = None) -> Rule:
    """The RBAC rule an API request needs, e.g. ``GET /api/v1/nodes`` -> ("", "nodes", "list")."""
    parts = [p for p in path.strip("/").split("/") if p]
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        raise ValueError(f"not a Kubernetes API path: {path}")
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    resource = rest[0]
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    method = method.upper()
    if method == "GET":
        verb = "watch" if (params or {}).get("watch") else ("get" if named else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return group, resource, verb
