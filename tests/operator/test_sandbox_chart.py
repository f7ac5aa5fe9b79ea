"""The kinds the chart renders, served by the sandbox's API server as a real one serves them
(real kubectl: short names, namespaced or not, server-side dry runs), a real `helm install`
(Helm's Go SDK) into it, and the sandbox's Deployment controller running the chart's operator
Deployment as pods."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml

from omni_operator.crd import crd
from omni_operator.sandbox.chart import install_chart
from omni_operator.sandbox.cluster import kubeconfig
from omni_operator.sandbox.deployments import DeploymentController, owner_uid
from omni_operator.sandbox.emulator import Emulator

pytestmark = pytest.mark.asyncio
KUBECTL = str(Path(sys.executable).parent / "kubectl")
NS = "omni-system"


class Api:
    def __init__(self, emu: Emulator, path: Path, url: str) -> None:
        self.emu, self.url = emu, url
        self.env = {**os.environ, "KUBECONFIG": str(path)}
        self.kubeconfig = path

    async def kubectl(self, *args: str, stdin: str | None = None) -> str:
        proc = await asyncio.create_subprocess_exec(
            KUBECTL, *args, env=self.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), 60)
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
        return out.decode()


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with Emulator() as emu, kmock.Server(emu) as server:
        url = str(server.url).rstrip("/")
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(url)))
        yield Api(emu, path, url)


KINDS = {  # kind -> (short name or plural, namespaced, a minimal object)
    "Deployment": ("deploy", True, {"apiVersion": "apps/v1", "spec": {
        "replicas": 0, "selector": {"matchLabels": {"a": "b"}},
        "template": {"metadata": {"labels": {"a": "b"}},
                     "spec": {"containers": [{"name": "c", "image": "x"}]}}}}),
    "ServiceAccount": ("sa", True, {"apiVersion": "v1"}),
    "Role": ("roles", True, {"apiVersion": "rbac.authorization.k8s.io/v1", "rules": []}),
    "RoleBinding": ("rolebindings", True, {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
        "subjects": [{"kind": "ServiceAccount", "name": "s", "namespace": NS}]}),
    "ClusterRole": ("clusterroles", False, {"apiVersion": "rbac.authorization.k8s.io/v1",
                                            "rules": []}),
    "ClusterRoleBinding": ("clusterrolebindings", False, {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "r"}, "subjects": []}),
    "NetworkPolicy": ("netpol", True, {"apiVersion": "networking.k8s.io/v1",
                                       "spec": {"podSelector": {}}}),
}  # fmt: skip


async def test_the_charts_kinds_are_served_by_short_name_and_scope(api: Api) -> None:
    await api.kubectl("create", "namespace", NS)
    docs = [{**body, "kind": kind, "metadata": {"name": f"x-{kind.lower()}"}}
            for kind, (_, _, body) in KINDS.items()]  # fmt: skip
    stream = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    await api.kubectl("apply", "-n", NS, "-f", "-", stdin=stream)
    for kind, (short, namespaced, _) in KINDS.items():
        name = f"x-{kind.lower()}"
        got = json.loads(await api.kubectl("get", short, name, "-n", NS, "-o", "json"))
        assert got["kind"] == kind and ("namespace" in got["metadata"]) == namespaced, got
        listed = await api.kubectl("get", short, "-A", "-o", "name")
        assert name in listed
        await api.kubectl("delete", short, name, "-n", NS)
        assert name not in await api.kubectl("get", short, "-A", "-o", "name")
    # client-go's typed writes are protobuf: Secrets and ConfigMaps are read (Helm's records)
    await api.kubectl("create", "secret", "generic", "s", "-n", NS, "--from-literal=k=v")
    await api.kubectl("create", "configmap", "c", "-n", NS, "--from-literal=k=v")
    secret = json.loads(await api.kubectl("get", "secret", "s", "-n", NS, "-o", "json"))
    assert secret["data"] == {"k": "dg=="} and secret["type"] == "Opaque"
    assert api.emu.stored("v1/configmaps", NS, "c")["data"] == {"k": "v"}  # type: ignore[index]
    resources = await api.kubectl("api-resources", "--api-group=apps")
    assert any(line.split()[:2] == ["deployments", "deploy"] for line in resources.splitlines())


async def test_the_rendered_chart_passes_a_server_side_dry_run_and_stores_nothing(
    api: Api,
) -> None:
    import helm_python as helm

    from omni_operator.sandbox.chart import CHART_DIR

    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render({}, name="omni", namespace=NS)
        crds = [c["data"] for c in chart.crds]
    stream = "\n---\n".join(t for p, t in sorted(rendered.items()) if not p.endswith(".txt"))
    await api.kubectl("create", "namespace", NS)
    await api.kubectl("apply", "-f", "-", stdin="\n---\n".join(crds))  # kopf's peerings too
    out = await api.kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", stdin=stream)
    assert "deployment.apps/omni-megascale-omni created (server dry run)" in out, out
    assert api.emu.stored_all("apps/v1/deployments") == []


async def test_helm_install_runs_the_operator_deployment_as_pods(api: Api) -> None:
    await api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(crd()))
    release = await asyncio.to_thread(install_chart, api.kubeconfig, namespace=NS)
    assert release["status"] == "deployed" and release["revision"] == 1
    secrets = await api.kubectl("get", "secrets", "-n", NS, "-o", "name")
    assert "secret/sh.helm.release.v1.omni.v1" in secrets  # Helm's release record
    (deploy,) = api.emu.stored_all("apps/v1/deployments", NS)
    assert api.emu.stored_all("kopf.dev/v1/kopfpeerings", NS)  # a CRD of the chart, served

    controller = DeploymentController(api.url)
    run = asyncio.create_task(controller.run())
    try:
        pods = await _until(lambda: api.emu.stored_all("v1/pods", NS))
        (pod,) = pods
        assert owner_uid(pod) == deploy["metadata"]["uid"]
        assert pod["metadata"]["name"].startswith("omni-megascale-omni-")
        await api.kubectl("delete", "pod", "-n", NS, pod["metadata"]["name"])
        (again,) = await _until(lambda: api.emu.stored_all("v1/pods", NS))  # recreated
        assert again["metadata"]["name"] != pod["metadata"]["name"]
        status = {"phase": "Running", "containerStatuses": [{"name": "operator", "ready": True}]}
        await api.kubectl("patch", "pod", "-n", NS, again["metadata"]["name"],
                          "--subresource=status", "--type=merge", "-p",
                          json.dumps({"status": status}))  # fmt: skip
        await api.kubectl("wait", "-n", NS, "--for=condition=Available", "deploy",
                          "omni-megascale-omni", "--timeout=20s")  # fmt: skip
        out = await api.kubectl("rollout", "status", "-n", NS, "deploy/omni-megascale-omni",
                                "--timeout=20s")  # fmt: skip
        assert "successfully rolled out" in out, out
        table = (await api.kubectl("get", "deploy", "-n", NS)).splitlines()
        assert table[0].split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
        assert table[1].split()[:4] == ["omni-megascale-omni", "1/1", "1", "1"]
        await api.kubectl("delete", "deploy", "-n", NS, "omni-megascale-omni")
        await _until(lambda: not api.emu.stored_all("v1/pods", NS))  # collected
    finally:
        run.cancel()


async def _until(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")
