"""Least-privilege RBAC: the chart grants exactly REQUIRED, and the code calls nothing more.

KEEP IN SYNC: REQUIRED mirrors the comment table in charts/megascale-omni/templates/rbac.yaml.
When a handler in omni_operator starts calling a new resource or verb, add it to both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from .conftest import NAMESPACE, REPO, VALUE_SETS, by_kind, render

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)


def _rules(group: str, resources: list[str], verbs: list[str]) -> set[Rule]:
    return {(group, r, v) for r in resources for v in verbs}


CRUD = ["create", "get", "list", "watch", "delete"]
# What the operator's handlers call in a namespace it serves.
NAMESPACED: set[Rule] = (
    _rules("omni.megascale.io", ["omnitrainingjobs"], ["get", "list", "watch", "patch"])
    | _rules("omni.megascale.io", ["omnitrainingjobs/status"], ["patch"])
    | _rules("", ["pods", "services", "configmaps"], CRUD)
    | _rules("", ["events"], ["create"])
)
VOLCANO: set[Rule] = _rules("scheduling.volcano.sh", ["podgroups"], CRUD)
NODES: set[Rule] = _rules("", ["nodes"], ["get", "list", "watch"])
PEERING = ["get", "list", "watch", "patch"]
CLUSTER_PEERING: set[Rule] = _rules("kopf.dev", ["clusterkopfpeerings"], PEERING)
NS_PEERING: set[Rule] = _rules("kopf.dev", ["kopfpeerings"], PEERING)


def granted(objects: list[dict[str, Any]]) -> dict[str | None, set[Rule]]:
    """Scope (None = cluster, else namespace) -> rules bound to the operator's ServiceAccount."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in {"Role", "ClusterRole"}
    }
    out: dict[str | None, set[Rule]] = {}
    for b in [*by_kind(objects, "ClusterRoleBinding"), *by_kind(objects, "RoleBinding")]:
        ns = b["metadata"].get("namespace")
        ref = b["roleRef"]
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        (subject,) = b["subjects"]
        assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
        assert subject["name"] in {"omni-megascale-omni", "omni-op"}  # default / values
        rules = out.setdefault(ns, set())
        for r in role["rules"]:
            assert set(r) == {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs"
            assert "*" not in r["verbs"] and "*" not in r["resources"]
            rules |= {(g, res, v) for g in r["apiGroups"] for res in r["resources"]
                      for v in r["verbs"]}  # fmt: skip
    return out


def test_cluster_wide_grants_exactly_what_is_required(chart: Any) -> None:
    assert granted(render(chart, {})) == {None: NODES | NAMESPACED | CLUSTER_PEERING}


def test_namespaced_grants_exactly_what_is_required(chart: Any) -> None:
    got = granted(render(chart, VALUE_SETS["namespaced-full"]))
    per_ns = NAMESPACED | VOLCANO | NS_PEERING
    assert got == {None: NODES, "team-a": per_ns, "team-b": per_ns}


def test_rbac_can_be_left_to_the_cluster_admin(chart: Any) -> None:
    assert granted(render(chart, VALUE_SETS["minimal"])) == {}


# -- the calls in code -------------------------------------------------------------------------
OPERATOR_SRC = REPO / "operator" / "omni_operator"
_SNAKE_TO_PLURAL = {
    "pod": "pods",
    "service": "services",
    "config_map": "configmaps",
    "event": "events",
    "namespaced_event": "events",
    "node": "nodes",
}
_VERB = {"read": "get", "list": "list", "create": "create", "delete": "delete",
         "patch": "patch", "replace": "update", "watch": "watch"}  # fmt: skip
# kubernetes / kubernetes_asyncio client methods: create_namespaced_pod, read_node, ...
_CLIENT_CALL = re.compile(
    r"\.(read|list|create|delete|patch|replace)_(?:namespaced_)?([a-z_]+?)"
    r"(_status|_for_all_namespaces)?\("
)
# kopf handlers and indexes on a resource: kopf watches (list + watch) it.
_KOPF_WATCH = re.compile(
    r"@kopf\.(?:on\.\w+|index|timer|daemon)\(\s*(?:\"[\w.]+\",\s*\"\w+\",\s*)?\"(\w+)\""
)


def calls_in_code(root: Path = OPERATOR_SRC) -> set[tuple[str, str]]:
    """(resource, verb) pairs the operator's source calls through a Kubernetes client or kopf."""
    found: set[tuple[str, str]] = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        for verb, snake, suffix in _CLIENT_CALL.findall(text):
            if snake == "custom_object" or snake not in _SNAKE_TO_PLURAL:
                continue
            resource = _SNAKE_TO_PLURAL[snake] + ("/status" if suffix == "_status" else "")
            found.add((resource, _VERB[verb]))
        for resource in _KOPF_WATCH.findall(text):
            found |= {(resource, "list"), (resource, "watch")}
    return found


def test_scanner_sees_client_calls(tmp_path: Path) -> None:
    (tmp_path / "h.py").write_text(
        '@kopf.on.create("omni.megascale.io", "v1alpha1", "omnitrainingjobs")\n'
        "async def f(**_): await core.create_namespaced_pod(ns, body)\n"
        "core.read_node(name); core.list_pod_for_all_namespaces()\n"
    )
    assert calls_in_code(tmp_path) == {
        ("omnitrainingjobs", "list"),
        ("omnitrainingjobs", "watch"),
        ("pods", "create"),
        ("nodes", "get"),
        ("pods", "list"),
    }


def test_every_call_in_code_is_granted(chart: Any) -> None:
    """Code -> RBAC: a handler calling something the chart does not grant fails here first,
    not with a 403 in a cluster."""
    rules = granted(render(chart, {"operator": {"volcano": True}}))[None]
    grants = {(res, verb) for _, res, verb in rules}
    missing = calls_in_code() - grants
    assert not missing, f"add to templates/rbac.yaml and REQUIRED here: {sorted(missing)}"


@pytest.mark.skipif(
    not (OPERATOR_SRC / "handlers").exists(), reason="arrives with omni_operator.handlers"
)
def test_every_grant_is_used_by_code() -> None:
    """RBAC -> code: each application grant has a call (kopf itself implies: patch on the job
    for finalizers/annotations, status patch, events create)."""
    used = calls_in_code() | {
        ("omnitrainingjobs", "get"),
        ("omnitrainingjobs", "patch"),
        ("omnitrainingjobs/status", "patch"),
        ("events", "create"),
    }
    unused = {(res, verb) for _, res, verb in NAMESPACED | NODES} - used
    assert not unused, f"granted but never called (remove from rbac.yaml): {sorted(unused)}"
