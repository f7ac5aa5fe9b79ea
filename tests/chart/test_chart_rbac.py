"""Least-privilege RBAC: the chart grants exactly ``omni_operator.rbac``'s table.

The operator's API client refuses calls outside ``HANDLER_RULES`` (so code cannot need more than
the table), and tests/operator runs a lifecycle that uses every handler rule (so the table holds
nothing unused). Here: the rendered RBAC equals the table, per scope and option.
"""

from __future__ import annotations

from typing import Any

from omni_operator.rbac import ADMISSION_RULES, HANDLER_RULES, KOPF_RULES

from .conftest import CLUSTER_WIDE, NAMESPACE, VALUE_SETS, by_kind, render

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)

NODES: set[Rule] = {r for r in HANDLER_RULES | KOPF_RULES if r[1] in ("nodes", "priorityclasses")}
VOLCANO: set[Rule] = {r for r in HANDLER_RULES if r[0] == "scheduling.volcano.sh"}
NAMESPACED: set[Rule] = (HANDLER_RULES | KOPF_RULES | ADMISSION_RULES) - NODES - VOLCANO
PEERING = ["get", "list", "watch", "patch"]
CLUSTER_PEERING: set[Rule] = {("kopf.dev", "clusterkopfpeerings", v) for v in PEERING}
NS_PEERING: set[Rule] = {("kopf.dev", "kopfpeerings", v) for v in PEERING}


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


def test_the_default_is_a_role_in_the_release_namespace(chart: Any) -> None:
    """No ClusterRole may touch pods, Services or ConfigMaps unless asked (kube-system...)."""
    assert granted(render(chart, {})) == {None: NODES, NAMESPACE: NAMESPACED | NS_PEERING}


def test_cluster_wide_only_when_asked(chart: Any) -> None:
    got = granted(render(chart, CLUSTER_WIDE))
    assert got == {None: NODES | NAMESPACED | CLUSTER_PEERING}


def test_namespaced_grants_exactly_what_is_required(chart: Any) -> None:
    got = granted(render(chart, VALUE_SETS["namespaced-full"]))
    per_ns = NAMESPACED | VOLCANO | NS_PEERING
    assert got == {None: NODES, "team-a": per_ns, "team-b": per_ns}


def test_owner_finalizers_update_is_granted_for_block_owner_deletion(chart: Any) -> None:
    """Clusters enforcing OwnerReferencesPermissionEnforcement answer 403 to creating an object
    with ``blockOwnerDeletion`` unless this is granted."""
    rule = ("omni.megascale.io", "omnitrainingjobs/finalizers", "update")
    assert rule in granted(render(chart, CLUSTER_WIDE))[None]
    assert rule in granted(render(chart, {}))[NAMESPACE]
    assert all(
        rule in rules
        for ns, rules in granted(render(chart, VALUE_SETS["namespaced-full"])).items()
        if ns
    )


def test_rbac_can_be_left_to_the_cluster_admin(chart: Any) -> None:
    assert granted(render(chart, VALUE_SETS["minimal"])) == {}
