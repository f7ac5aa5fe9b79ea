"""Render the chart with real Helm (helm-python-sdk: Helm v4's Go SDK in a wheel), offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "megascale-omni"
RELEASE = "omni"
NAMESPACE = "omni-system"

# Value sets every rendering test runs with: the defaults and two far-apart non-default setups.
CLUSTER_WIDE: dict[str, Any] = {"operator": {"clusterWide": True}}
"""Every namespace, only when asked (not in VALUE_SETS: each set costs a lint and a render)."""
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced-full": {
        "image": {"repository": "registry.example.com/omni/operator", "tag": "1.2.3"},
        "imagePullSecrets": [{"name": "regcred"}],
        "operator": {
            "watchNamespaces": ["team-a", "team-b"],
            "peering": {"enabled": True, "name": "omni-peering", "priority": 200},
            "volcano": True,
            "verbose": True,
            "extraArgs": ["--log-format=json"],
            "extraEnv": [{"name": "OMNI_EXTRA", "value": "1"}],
        },
        "serviceAccount": {"name": "omni-op", "annotations": {"team": "ml-infra"}},
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "1", "memory": "1Gi"},
        },
        "podAnnotations": {"example.com/owner": "ml-infra"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "metrics": {
            "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
            "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
        },
        "dashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "Omni"}},
    },
    "minimal": {
        "operator": {"peering": {"enabled": False}},
        "rbac": {"create": False},
        "serviceAccount": {"create": False},
        "metrics": {"service": {"enabled": False}},
        "dashboards": {"enabled": False},
        "networkPolicy": {"enabled": False},
    },
}


@pytest.fixture(scope="session")
def chart() -> Any:
    import helm_python as helm

    return helm.Chart.load(CHART_DIR)


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the release would create from templates/ (CRDs are in chart.crds)."""
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


def crds(chart: Any) -> list[dict[str, Any]]:
    return [doc for c in chart.crds for doc in yaml.safe_load_all(c["data"]) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]
