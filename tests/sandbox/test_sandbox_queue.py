"""Two 2-node jobs on three 1-GPU sandbox nodes: they never share a GPU. The second waits in
``Queued``, saying for what, until two GPUs are free (a pod of the first job that ended frees its
node's GPU), then trains and succeeds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from omni_operator.kube_objects import pod_node

from .test_sandbox_e2e import Sandbox, _manifest, _pods

STEPS = 4
JOB = "omni.megascale.io/job"
ENDED = ("Succeeded", "Failed")


def _job(path: Path, name: str) -> None:
    _manifest(path, step_log=f"runs/{name}/steps.jsonl", checkpoint=None, steps=STEPS)
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["gpusPerNode"] = 1
    doc["spec"]["resources"] = {"cpu": "100m"}  # GPUs, not CPU, keep the jobs apart
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_two_jobs_never_share_a_gpu_and_the_second_waits_queued(tmp_path: Path) -> None:
    _job(tmp_path / "first.yaml", "first")
    _job(tmp_path / "second.yaml", "second")
    with Sandbox(tmp_path, nodes=3, args=("--gpus-per-node", "1")) as sb:
        sb.kubectl("apply", "-f", "first.yaml")
        sb.wait("first placed", lambda: sb.job("first").get("status", {}).get("placement"),
                timeout=60)  # fmt: skip
        sb.kubectl("apply", "-f", "second.yaml")

        def second() -> dict[str, Any]:
            return sb.job("second").get("status") or {}

        sb.wait("second queued", lambda: second().get("phase") == "Queued", timeout=60,
                detail=second)  # fmt: skip
        assert second()["message"] == "queued: 2 nodes with 1 free GPU; 1 now"
        seen_running, deadline = False, time.monotonic() + 240
        while True:  # until the second job has pods: none on a node whose GPU the first holds
            assert time.monotonic() < deadline, f"the second job got no pods: {second()}"
            pods = list(_pods(sb).values())
            by_job = {j: [p for p in pods if p["metadata"]["labels"][JOB] == j]
                      for j in ("first", "second")}  # fmt: skip
            if by_job["second"]:
                # a pod that ended frees its node's GPU (the first job's ranks may end apart)
                held = {pod_node(p) for p in by_job["first"]
                        if p["status"].get("phase") not in ENDED}  # fmt: skip
                placed = {pod_node(p) for p in by_job["second"]}
                assert None not in placed, "the operator names the node of each pod it places"
                assert not held & placed, (
                    f"the second job's pods came to {sorted(held & placed)} while the first's "
                    "pods held their GPUs"
                )
                break
            seen_running |= sb.job("first")["status"]["phase"] == "Running"
            time.sleep(0.5)
        assert seen_running
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/second",
                   "--timeout=240s", timeout=260)  # fmt: skip
        cond = {c["type"]: c for c in second()["conditions"]}["Queued"]
        assert cond["status"] == "False" and cond["reason"] == "Admitted"
        assert second()["step"] == STEPS
