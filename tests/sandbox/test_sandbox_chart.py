"""The user's whole path with the chart: `helm install` (Helm's Go SDK) into a sandbox that runs
no operator of its own, the operator runs as its Deployment's pod (the chart's image, args and
service account, as on a cluster), and a job applied afterwards trains under it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from omni_trainer.components.progress import read_step_log

from .test_sandbox_e2e import OMNI, SANDBOX_DIR, Sandbox, _manifest

NS = "omni-system"
"""The release namespace: by default the chart's operator handles the jobs there."""
DEPLOY = "omni-megascale-omni"
STEPS = 5


def test_the_chart_installed_by_helm_runs_the_operator_and_a_job_trains_under_it(
    tmp_path: Path,
) -> None:
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint=None,
              steps=STEPS)  # fmt: skip
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    doc["spec"]["nodes"] = 1
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with Sandbox(tmp_path, nodes=2, args=("--no-operator",)) as sb:
        kubectl = sb.kubectl
        out = subprocess.run([*OMNI, "sandbox", "install-chart", "--dir", SANDBOX_DIR],
                             cwd=tmp_path, env=sb.env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert f"release omni deployed in namespace {NS}" in out.stdout, out.stdout
        assert "sh.helm.release.v1.omni.v1" in kubectl("-n", NS, "get", "secrets", "-o", "name")
        kubectl("-n", NS, "rollout", "status", f"deploy/{DEPLOY}", "--timeout=180s", timeout=200)
        selector = "app.kubernetes.io/instance=omni,app.kubernetes.io/component=operator"
        pods = json.loads(kubectl("-n", NS, "get", "pods", "-l", selector, "-o", "json"))
        (pod,) = pods["items"]
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["kind"] == "Deployment" and owner["name"] == DEPLOY
        assert pod["metadata"]["name"].startswith(f"{DEPLOY}-")
        assert pod["status"]["containerStatuses"][0]["ready"]

        kubectl("-n", NS, "apply", "-f", "job.yaml")
        kubectl("-n", NS, "wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                "--timeout=420s", timeout=450)  # fmt: skip
        status = json.loads(kubectl("-n", NS, "get", "otj", "tiny-cpu", "-o", "json"))["status"]
        assert status["step"] == STEPS and status["restarts"] == 0
        table = kubectl("-n", NS, "get", "deploy").splitlines()
        assert table[0].split()[:4] == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE"]
        assert table[1].split()[:4] == [DEPLOY, "1/1", "1", "1"], table
        operator_log = kubectl("-n", NS, "logs", pod["metadata"]["name"])
        assert "tiny-cpu" in operator_log  # the chart's operator did the work
    assert "sandbox-operator" not in sb.log.read_text()
    assert list(read_step_log(tmp_path / "runs/job/steps.jsonl")) == list(range(1, STEPS + 1))
