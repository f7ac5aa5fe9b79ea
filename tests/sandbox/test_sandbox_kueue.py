"""Kueue as the admission path, in the sandbox's emulation of Kueue's pod integration: a job
held far beyond its start deadline stays Queued and trains once admitted; a preemption mid-run
is a graceful stop (emergency checkpoint), costs no restart, and the job resumes exactly when
Kueue admits it again."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from omni_operator.spec import DEFAULT_IMAGE
from omni_trainer.components.progress import read_step_log

from .test_sandbox_e2e import Sandbox, _manifest, uninterrupted_run

STEPS = 40
START_TIMEOUT_S = 10
"""The start deadline while the job waits for Kueue (the least the spec allows); it is held
three times as long. Before admission it is raised to what a cold start of two trainers takes
on a loaded machine (the unit tests check that it counts from admission)."""
QUEUES = """
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: gpus}
spec:
  namespaceSelector: {}
  preemption: {withinClusterQueue: LowerPriority}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors:
    - name: default-flavor
      resources: [{name: nvidia.com/gpu, nominalQuota: %d}]
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata: {name: team, namespace: default}
spec: {clusterQueue: gpus}
"""
URGENT = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "urgent", "labels": {"kueue.x-k8s.io/queue-name": "team"}},
    "spec": {
        "priorityClassName": "urgent",
        "nodeSelector": {"kubernetes.io/hostname": "node-2"},
        "restartPolicy": "Never",
        "containers": [{"name": "c", "image": DEFAULT_IMAGE,
                        "command": [sys.executable, "-c", "import time; time.sleep(3)"],
                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
    },
}  # fmt: skip
URGENT_CLASS = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": "urgent"}, "value": 1000}  # fmt: skip


def _job(path: Path, *, checkpoint: str | None, step_log: str) -> None:
    _manifest(path, step_log=step_log, checkpoint=checkpoint, steps=STEPS)
    doc = yaml.safe_load(path.read_text())
    spec = doc["spec"]
    spec["gpusPerNode"] = 1
    spec["resources"] = {"cpu": "100m"}
    spec["scheduling"] = {"kueueQueue": "team"}
    spec["restartPolicy"]["startTimeoutSeconds"] = START_TIMEOUT_S
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_queued_past_its_start_deadline_then_preempted_and_resumed_exactly(
    tmp_path: Path,
) -> None:
    _job(tmp_path / "job.yaml", checkpoint="runs/job/ckpt", step_log="runs/job/steps.jsonl")
    _job(tmp_path / "ref.yaml", checkpoint=None, step_log="runs/ref/steps.jsonl")
    (tmp_path / "queues.yaml").write_text(QUEUES % 0)
    (tmp_path / "urgent.yaml").write_text(yaml.safe_dump_all([URGENT_CLASS, URGENT]))
    with Sandbox(tmp_path, nodes=3, args=("--gpus-per-node", "1")) as sb:

        def status() -> dict[str, Any]:
            return sb.job("tiny-cpu").get("status") or {}

        sb.kubectl("apply", "-f", "queues.yaml")
        sb.kubectl("apply", "-f", "job.yaml")
        sb.wait("Queued", lambda: status().get("phase") == "Queued", timeout=60, detail=status)
        held_since = time.monotonic()
        want = uninterrupted_run(tmp_path)  # the reference, while the job is held
        time.sleep(max(0.0, 3 * START_TIMEOUT_S - (time.monotonic() - held_since)))
        st = status()
        assert st["phase"] == "Queued" and st["restarts"] == 0 and st["attempt"] == 0, st
        assert "gated by Kueue (LocalQueue team): SchedulingGated" in st["message"]
        budget = st["restartBudgetLeft"]

        sb.kubectl("patch", "otj", "tiny-cpu", "--type=merge", "-p",
                   '{"spec": {"restartPolicy": {"startTimeoutSeconds": 600}}}')  # fmt: skip
        (tmp_path / "queues.yaml").write_text(QUEUES % 2)
        sb.kubectl("apply", "-f", "queues.yaml")  # quota for it: admitted
        sb.wait("training", lambda: (status().get("step") or 0) >= 3, timeout=240, detail=status)
        sb.kubectl("apply", "-f", "urgent.yaml")  # a higher priority: Kueue preempts the job
        sb.wait("preempted", lambda: status().get("attempt") == 1, timeout=120, detail=status)
        st = status()
        assert st["phase"] == "Queued" and "Preempted" in st["message"], st
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=300s", timeout=320)  # fmt: skip
        st = status()
        assert st["restarts"] == 0 and st["restartBudgetLeft"] == budget, st
        assert st["step"] == STEPS and st["attempt"] == 1
        urgent = json.loads(sb.kubectl("get", "pod", "urgent", "-o", "json"))
        assert urgent["status"]["phase"] == "Succeeded"

    records = [json.loads(x) for x in (tmp_path / "runs/job/steps.jsonl").read_text().splitlines()]
    last_of_0 = max(r["step"] for r in records if r["attempt"] == 0)
    first_of_1 = min(r["step"] for r in records if r["attempt"] == 1)
    assert first_of_1 == last_of_0 + 1  # the emergency checkpoint: no step recomputed
    got = read_step_log(tmp_path / "runs/job/steps.jsonl")
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
