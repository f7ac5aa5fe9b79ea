"""``helm install`` of the chart into the sandbox: ``omni sandbox install-chart``.

A real install through Helm's Go SDK (``helm-python-sdk``, the Helm the chart tests use): its
CRDs first, then the rendered objects by server-side apply, the release recorded in a Secret of
the release namespace (``helm list`` finds it), against the sandbox's kubeconfig. The sandbox
then runs the chart's operator as its Deployment's pod (:mod:`.deployments`, :mod:`.kubelet`);
start the sandbox with ``--no-operator`` so that this one is the only operator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CHART_DIR = Path(__file__).resolve().parents[3] / "charts" / "megascale-omni"
"""The source tree's chart (the sandbox runs from a checkout)."""
RELEASE = "omni"
NAMESPACE = "omni-system"


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` key by key (nested mappings merge; the rest replaces), as
    Helm merges ``--set`` into values."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def set_values(expressions: Iterable[str]) -> dict[str, Any]:
    """``--set a.b=c`` expressions as values, parsed by Helm's own parser."""
    import helm_python as helm

    values: dict[str, Any] = {}
    for expr in expressions:
        values = merge(values, helm.parse_set_string(expr))
    return values


def install_chart(
    kubeconfig: Path,
    *,
    chart: Path = CHART_DIR,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Install ``chart`` as ``release`` into ``namespace`` (created if missing) of the cluster
    ``kubeconfig`` names; returns Helm's release summary (``status``, ``notes``, ``manifest``).

    Raises:
        helm_python.errors.HelmError: what Helm says when the install fails.
    """
    import helm_python as helm

    with (
        helm.Config(kubeconfig_path=kubeconfig, namespace=namespace) as config,
        helm.Chart.load(chart) as loaded,
    ):
        return dict(
            config.install(
                loaded, release, dict(values or {}), namespace=namespace, create_namespace=True
            )
        )
