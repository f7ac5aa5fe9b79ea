"""End to end through `omni sandbox` and real kubectl: a node is lost mid-run, the operator
restarts the job from its checkpoint on other nodes, and the loss curve equals an uninterrupted
run's.

Everything is a real process: the sandbox (API emulator, kubelet simulator, kopf operator), the
kubectl binary, the pods' torchrun trainers (2 nodes x 1 CPU process), and the reference
`omni train --nproc 2` run afterwards on the same manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_trainer.components.progress import read_step_log

from ..conftest import EXAMPLES

pytestmark = pytest.mark.timeout(900)

BIN = Path(sys.executable).parent
OMNI = [sys.executable, "-m", "omni_trainer.cli"]
STEPS = 40
SANDBOX_DIR = ".sandbox"


def _manifest(path: Path, *, step_log: str, checkpoint: str | None) -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    spec = doc["spec"]
    spec["nodes"] = 2  # two pods on two sandbox nodes: a real cross-node torchrun rendezvous
    spec["restartPolicy"] = {"nodeLostGraceSeconds": 5, "backoffSeconds": {"base": 0, "max": 0}}
    trainer = spec["trainer"]
    trainer["train"].update(steps=STEPS, stepLog=step_log)
    if checkpoint:
        trainer["checkpoint"] = {"path": checkpoint, "intervalSteps": 10}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _wait(what: str, check: Callable[[], Any], *, timeout: float, logs: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    tail = logs.read_text(errors="replace")[-4000:] if logs.exists() else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; sandbox log tail:\n{tail}")


def _kubectl(tmp_path: Path) -> Callable[..., str]:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / SANDBOX_DIR / "kubeconfig")}

    def kubectl(*args: str, timeout: float = 120) -> str:
        out = subprocess.run([str(BIN / "kubectl"), *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=timeout)  # fmt: skip
        assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
        return out.stdout

    return kubectl


def test_a_missing_image_fails_the_job_naming_it_within_the_start_timeout(
    tmp_path: Path,
) -> None:
    """The sandbox's registry holds only the images it was given; the kubelet reports the
    others as a real one does, and the operator ends the job in Failed at once, naming the
    image, instead of showing Running forever."""
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint=None)
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    missing = "ghcr.io/megascale-omni/trainer:0.0.9"
    doc["spec"]["image"] = missing
    doc["spec"]["restartPolicy"]["startTimeoutSeconds"] = 60
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    sandbox_log = tmp_path / "sandbox.log"
    kubectl = _kubectl(tmp_path)
    with sandbox_log.open("w") as log:
        sandbox = subprocess.Popen(
            [*OMNI, "sandbox", "up", "--nodes", "2", "--gpus-per-node", "0", "--resync", "1",
             "--dir", SANDBOX_DIR, "--image", "ghcr.io/megascale-omni/trainer:0.1.0"],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait("the sandbox", (tmp_path / SANDBOX_DIR / "sandbox.json").exists, timeout=120,
              logs=sandbox_log)  # fmt: skip
        kubectl("apply", "--validate=false", "-f", "job.yaml")
        start = time.monotonic()
        kubectl("wait", "--for=jsonpath={.status.phase}=Failed", "otj/tiny-cpu",
                "--timeout=60s")  # fmt: skip
        assert time.monotonic() - start < 60
        status = json.loads(kubectl("get", "otj", "tiny-cpu", "-o", "json"))["status"]
        assert f"image {missing} cannot be pulled" in status["message"], status["message"]
        assert "ErrImagePull" in status["message"] or "ImagePullBackOff" in status["message"]
        failed = {c["type"]: c for c in status["conditions"]}["Failed"]
        assert failed["reason"] == "ImagePullFailed" and status["restarts"] == 0
        assert f"image {missing} is not in the registry" in sandbox_log.read_text()
        assert "registry: ghcr.io/megascale-omni/trainer:0.1.0" in sandbox_log.read_text()
    finally:
        sandbox.terminate()
        try:
            sandbox.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sandbox.kill()


def test_graceful_delete_then_node_lost_resume_and_match_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """A pod deleted with its grace period: every trainer stops after the same step, writes an
    emergency checkpoint, and the restart resumes from it (no step recomputed). Later a node
    is lost: the job restarts from its last checkpoint on other nodes."""
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt")
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None)
    sandbox_log = tmp_path / "sandbox.log"
    kubectl = _kubectl(tmp_path)

    def job() -> dict[str, Any]:
        return json.loads(kubectl("get", "otj", "tiny-cpu", "-o", "json"))

    with sandbox_log.open("w") as log:
        sandbox = subprocess.Popen(
            [*OMNI, "sandbox", "up", "--nodes", "4", "--gpus-per-node", "0", "--resync", "1",
             "--dir", SANDBOX_DIR],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait("the sandbox", (tmp_path / SANDBOX_DIR / "sandbox.json").exists, timeout=120,
              logs=sandbox_log)  # fmt: skip
        assert "node-3" in kubectl("get", "nodes")
        kubectl("apply", "--validate=false", "-f", "job.yaml")

        def checkpointed() -> int | None:
            step = ((job().get("status") or {}).get("lastCheckpoint") or {}).get("step")
            return step if step and step >= 10 else None

        _wait("a committed checkpoint in the job's status", checkpointed, timeout=400,
              logs=sandbox_log)  # fmt: skip
        kubectl("delete", "pod", "tiny-cpu-a0-n1", "--wait=false")  # the pod's grace
        _wait("attempt 1", lambda: (job().get("status") or {}).get("attempt") == 1, timeout=200,
              logs=sandbox_log)  # fmt: skip
        first = job()["status"]["restartHistory"][0]
        assert first["reason"] in ("PodDeleted", "GracefulStop"), first
        before = (job()["status"].get("lastCheckpoint") or {}).get("step") or 0

        def checkpointed_again() -> int | None:  # by attempt 1 (the old one's are not read)
            step = ((job().get("status") or {}).get("lastCheckpoint") or {}).get("step")
            return step if step and step > before else None

        _wait("a checkpoint of attempt 1", checkpointed_again, timeout=400, logs=sandbox_log)
        selector = "omni.megascale.io/attempt=1,omni.megascale.io/node-rank=1"
        (rank1,) = json.loads(kubectl("get", "pods", "-l", selector, "-o", "json"))["items"]
        lost = rank1["spec"]["nodeName"]
        out = subprocess.run([*OMNI, "sandbox", "fault", "node-lost", lost, "--dir", SANDBOX_DIR],
                             cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
        assert "fault=lost" in out.stdout

        kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                "--timeout=600s", timeout=660)  # fmt: skip
        status = job()["status"]
        assert status["restarts"] == 2 and status["attempt"] == 2
        graceful, restart = status["restartHistory"]
        assert graceful["lostSeconds"] is not None and graceful["mode"] == "recreate"
        assert restart["reason"] == "NodeLost" and restart["nodes"] == [lost]
        assert restart["fromStep"] > before  # resumed from attempt 1's checkpoint
        assert restart["lostSeconds"] > 0 and restart["stepsRecomputed"] >= 0
        assert lost not in status["placement"]
        nodes = kubectl("get", "nodes")
        assert any(line.split()[:2] == [lost, "NotReady"] for line in nodes.splitlines())

        events = json.loads(kubectl("get", "events", "--field-selector",
                                    "involvedObject.name=tiny-cpu", "-o", "json"))  # fmt: skip
        reasons = {e["reason"] for e in events["items"]}
        assert {"PodsCreated", "NodeLost", "Checkpoint", "Succeeded"} <= reasons, reasons
        rank0 = "tiny-cpu-a2-n0"
        assert f"training {STEPS} steps" in kubectl("logs", rank0)
        assert "Succeeded" in kubectl("get", "otj")  # the printer columns show the phase
    finally:
        sandbox.terminate()
        try:
            sandbox.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sandbox.kill()
    assert sandbox.returncode is not None

    log_path = tmp_path / "runs/job/steps.jsonl"
    got = read_step_log(log_path)
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["attempt"] for r in records} == {0, 1, 2}
    last_of_0 = max(r["step"] for r in records if r["attempt"] == 0)
    first_of_1 = min(r["step"] for r in records if r["attempt"] == 1)
    assert first_of_1 == last_of_0 + 1  # the graceful stop's checkpoint: no step recomputed

    subprocess.run([*OMNI, "train", "ref.yaml", "--nproc", "2"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    want = read_step_log(tmp_path / "runs/ref/steps.jsonl")
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
