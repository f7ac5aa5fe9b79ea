"""End to end through `omni sandbox` and real kubectl: a node is lost mid-run, the operator
restarts the job from its checkpoint on other nodes, and the loss curve equals an uninterrupted
run's.

Everything is a real process: the sandbox (API emulator, kubelet simulator, kopf operator), the
kubectl binary, the pods' torchrun trainers (2 nodes x 1 CPU process), and the reference
`omni train --nproc 2` run afterwards on the same manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.sandbox.control import inject_fault, read_state
from omni_trainer.components.progress import read_step_log

from ..conftest import EXAMPLES
from ..step_logs import read_step_samples

pytestmark = pytest.mark.timeout(900)

BIN = Path(sys.executable).parent
OMNI = [sys.executable, "-m", "omni_trainer.cli"]
STEPS = 40
GRACEFUL_STEPS = 120
"""The graceful-delete test's length: its second fault lands after a restart (at 40 steps the job
once finished before it)."""
RESTARTED_STEPS = 80
"""The restarted sandbox's job: long enough that the sandbox stops mid-run (at its second
checkpoint, step 10, once the other job's trainers started) even on an idle machine."""
REFERENCE_STEPS = 240
"""The longest uninterrupted run a test here compares with (the replaced straggler's). Every
sandbox job's learning rate decays over this many steps (``lrSchedule.decaySteps``), whatever
its length, so a job of N steps trains as the first N steps of a job of this length does, and
one uninterrupted run of this length serves every test of the session."""
SANDBOX_DIR = ".sandbox"
POD_THREADS = "1"
"""Intra-op threads of every trainer here (``OMNI_NUM_THREADS``, which the sandbox's pods inherit
from its environment): the sandbox's nodes and the suite's other lane share this machine's
cores, so a pod's trainer taking every core (its default) would only contend, and the
uninterrupted run must use the same count for its float sums to run in the same order."""


def _manifest(
    path: Path,
    *,
    step_log: str,
    checkpoint: str | None,
    steps: int = STEPS,
    decay_steps: int = REFERENCE_STEPS,
) -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    spec = doc["spec"]
    spec["nodes"] = 2  # two pods on two sandbox nodes: a real cross-node torchrun rendezvous
    spec["restartPolicy"] = {"nodeLostGraceSeconds": 5, "backoffSeconds": {"base": 0, "max": 0}}
    trainer = spec["trainer"]
    trainer["train"].update(steps=steps, stepLog=step_log)
    trainer["lrSchedule"]["decaySteps"] = decay_steps
    if checkpoint:
        trainer["checkpoint"] = {"path": checkpoint, "intervalSteps": 10}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


_REFERENCE_LOGS: dict[str, Path] = {}
"""Step logs of the uninterrupted runs of this session by the sha256 of what their losses depend
on (``spec.trainer``, its keys in any order, but for its length and step log)."""


def uninterrupted_run(cwd: Path) -> dict[int, float]:
    """Losses by step of ``ref.yaml`` (the job without faults), its steps only, from one run of
    the same trainer for as many steps as its learning rate decays over (``decaySteps``: see
    :data:`REFERENCE_STEPS`), trained by `omni train` on two local processes, with the
    intra-op threads of a sandbox pod (:data:`POD_THREADS`), so the float sums run in the same
    order and the curves compare bit for bit (at other thread counts they drift apart by ~1e-7
    a step). Its first steps' log is written to ``runs/ref/steps.jsonl``."""
    doc = yaml.safe_load((cwd / "ref.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    steps, longest = trainer["train"]["steps"], trainer["lrSchedule"].get("decaySteps")
    assert longest is not None and steps <= longest, (
        f"ref.yaml: {steps} steps, decaySteps {longest}: an uninterrupted run of decaySteps "
        "steps would not train as it does"
    )
    trainer["train"]["steps"], trainer["train"]["stepLog"] = longest, "runs/ref-whole/steps.jsonl"
    key = hashlib.sha256(json.dumps(trainer, sort_keys=True).encode()).hexdigest()
    if key not in _REFERENCE_LOGS:
        (cwd / "ref-whole.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        env = {**os.environ, "OMNI_NUM_THREADS": POD_THREADS}
        subprocess.run([*OMNI, "train", "ref-whole.yaml", "--nproc", "2"], cwd=cwd, env=env,
                       check=True, capture_output=True, timeout=600)  # fmt: skip
        _REFERENCE_LOGS[key] = cwd / "runs/ref-whole/steps.jsonl"
    lines = _REFERENCE_LOGS[key].read_text().splitlines(keepends=True)
    log = cwd / "runs/ref/steps.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(line for line in lines if json.loads(line)["step"] <= steps))
    return read_step_log(log)


def _wait(
    what: str,
    check: Callable[[], Any],
    *,
    timeout: float,
    logs: Path,
    detail: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``check`` until it is truthy; on timeout fail with ``detail()`` (e.g. the job's
    status) and the sandbox log's tail, so a CI failure says where the run stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    tail = logs.read_text(errors="replace")[-4000:] if logs.exists() else ""
    state = f"; {detail()}" if detail else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{state}; sandbox log:\n{tail}")


class Sandbox:
    """`omni sandbox up` in ``cwd`` (4 CPU nodes), and the real kubectl against it."""

    def __init__(
        self, cwd: Path, env: dict[str, str] | None = None, *, nodes: int = 4, args: tuple = ()
    ) -> None:
        self.cwd, self.log = cwd, cwd / "sandbox.log"
        self.env = {**(env or os.environ), "OMNI_NUM_THREADS": POD_THREADS,
                    "KUBECONFIG": str(cwd / SANDBOX_DIR / "kubeconfig")}  # fmt: skip
        self.argv = [*OMNI, "sandbox", "up", "--nodes", str(nodes), "--gpus-per-node", "0",
                     "--resync", "1", "--dir", SANDBOX_DIR, *args]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Sandbox:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self.wait("the sandbox", (self.cwd / SANDBOX_DIR / "sandbox.json").exists, timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run([str(BIN / "kubectl"), *args], cwd=self.cwd, env=self.env,
                             capture_output=True, text=True, timeout=timeout)  # fmt: skip
        assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
        return out.stdout

    def job(self, name: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "otj", name, "-o", "json"))

    def wait(
        self,
        what: str,
        check: Callable[[], Any],
        *,
        timeout: float,
        detail: Callable[[], Any] | None = None,
    ) -> Any:
        return _wait(what, check, timeout=timeout, logs=self.log, detail=detail)


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
    registry = ("--image", "ghcr.io/megascale-omni/trainer:0.1.0")
    with Sandbox(tmp_path, nodes=2, args=registry) as sb:
        kubectl = sb.kubectl
        kubectl("apply", "-f", "job.yaml")
        start = time.monotonic()
        kubectl("wait", "--for=jsonpath={.status.phase}=Failed", "otj/tiny-cpu",
                "--timeout=60s")  # fmt: skip
        assert time.monotonic() - start < 60
        status = sb.job("tiny-cpu")["status"]
        assert f"image {missing} cannot be pulled" in status["message"], status["message"]
        assert "ErrImagePull" in status["message"] or "ImagePullBackOff" in status["message"]
        failed = {c["type"]: c for c in status["conditions"]}["Failed"]
        assert failed["reason"] == "ImagePullFailed" and status["restarts"] == 0
        assert f"image {missing} is not in the registry" in sb.log.read_text()
        assert "registry: ghcr.io/megascale-omni/trainer:0.1.0" in sb.log.read_text()


def test_graceful_delete_then_node_lost_resume_and_match_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """A pod deleted with its grace period: every trainer stops after the same step, writes an
    emergency checkpoint, and the restart resumes from it (no step recomputed). Later a node
    is lost: the job restarts from its last checkpoint on other nodes."""
    # two faults, each timed by the status (which trails the trainer by ~10-15 s here): long
    # enough that the second lands while the job still trains (~0.3 s a step on this machine)
    steps = GRACEFUL_STEPS
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt",
              steps=steps)  # fmt: skip
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None,
              steps=steps)  # fmt: skip
    with Sandbox(tmp_path) as sb:
        kubectl = sb.kubectl

        def job() -> dict[str, Any]:
            return sb.job("tiny-cpu")

        assert "node-3" in kubectl("get", "nodes")
        kubectl("apply", "-f", "job.yaml")

        def checkpointed() -> int | None:
            step = ((job().get("status") or {}).get("lastCheckpoint") or {}).get("step")
            return step if step and step >= 10 else None

        sb.wait("a committed checkpoint in the job's status", checkpointed, timeout=400)
        kubectl("delete", "pod", "tiny-cpu-a0-n1", "--wait=false")  # the pod's grace
        sb.wait("attempt 1", lambda: (job().get("status") or {}).get("attempt") == 1, timeout=200)
        first = job()["status"]["restartHistory"][0]
        assert first["reason"] in ("PodDeleted", "GracefulStop"), first
        before = (job()["status"].get("lastCheckpoint") or {}).get("step") or 0

        def checkpointed_again() -> int | None:  # by attempt 1 (the old one's are not read)
            step = ((job().get("status") or {}).get("lastCheckpoint") or {}).get("step")
            return step if step and step > before else None

        sb.wait("a checkpoint of attempt 1", checkpointed_again, timeout=400)
        selector = "omni.megascale.io/attempt=1,omni.megascale.io/node-rank=1"
        (rank1,) = json.loads(kubectl("get", "pods", "-l", selector, "-o", "json"))["items"]
        lost = rank1["spec"]["nodeName"]
        assert "fault=lost" in _fault(tmp_path, "node-lost", lost)

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
        assert f"training {steps} steps" in kubectl("logs", rank0)
        assert status["step"] == steps  # the trainer's final figures, not the last scrape's
        table = kubectl(
            "get", "otj"
        ).splitlines()  # printer columns: phase, integer tokens/s, MFU %
        assert table[0].split() == ["NAME", "PHASE", "STEP", "TOKENS/S", "MFU", "RESTARTS", "AGE"]
        _, phase, step, tps, mfu, restarts, _ = table[1].split()
        assert (phase, step, restarts) == ("Succeeded", str(steps), "2")
        assert tps == str(status["tokensPerSecond"]) and tps.isdigit() and mfu.endswith("%")
        for args in ([], ["-o", "wide"], ["-A"], ["--field-selector", "reason=NodeLost"]):
            out = kubectl("get", "events", *args)  # tables of Events with real timestamps
            assert "NodeLost" in out and "<invalid>" not in out, out
    assert sb.proc is not None and sb.proc.returncode is not None

    log_path = tmp_path / "runs/job/steps.jsonl"
    got = read_step_log(log_path)
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["attempt"] for r in records} == {0, 1, 2}
    last_of_0 = max(r["step"] for r in records if r["attempt"] == 0)
    first_of_1 = min(r["step"] for r in records if r["attempt"] == 1)
    assert first_of_1 == last_of_0 + 1  # the graceful stop's checkpoint: no step recomputed
    resumed = min(r["step"] for r in records if r["attempt"] == 2) - 1  # as the trainer did
    assert restart["fromStep"] == resumed and restart["confirmed"], (restart, resumed)

    want = uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, steps + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)


def last_logged_step(log: Path) -> int:
    """The trainer's own last step (the step log is written as it trains; the status trails it
    by the progress interval, long enough for a fast job to finish); 0 before the first."""
    lines = log.read_text().splitlines() if log.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _fault(cwd: Path, fault: str, target: str) -> str:
    """What `omni sandbox fault FAULT TARGET` does, from this process: the CLI's Python start
    took 20-50 s on a busy 2-core machine, past the step a test times its fault for (the
    straggler tests run the CLI itself)."""
    return inject_fault(read_state(cwd / SANDBOX_DIR)["server"], fault, target)


def _pods(sb: Sandbox) -> dict[str, dict[str, Any]]:
    items = json.loads(sb.kubectl("get", "pods", "-o", "json"))["items"]
    return {p["metadata"]["name"]: p for p in items}


RUN_IN_PLACE_STEPS = 150
"""Long enough that both faults land while training runs (about 0.3 s a step on this machine;
on CI beside the other lane, 100 steps once ended with the second fault)."""


def test_a_crashed_trainer_and_a_dead_container_restart_in_place_exactly(tmp_path: Path) -> None:
    """restartPolicy.mode in-place (the default): a trainer process crash (`crash-pod`: every
    process of the pod but its supervisor, which reports it from the running container) and
    then a whole container killed (`kill-pod`, the kubelet restarts the container in its pod)
    each restart every trainer inside the same pods
    (UIDs unchanged), from the latest checkpoint; the loss and the samples of every step equal
    an uninterrupted run's."""
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt")
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None)
    for name in ("job", "ref"):
        doc = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
        doc["spec"]["trainer"]["train"]["steps"] = RUN_IN_PLACE_STEPS
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with Sandbox(tmp_path) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def status() -> dict[str, Any]:
            return sb.job("tiny-cpu").get("status") or {}

        def logged() -> int:
            return last_logged_step(tmp_path / "runs/job/steps.jsonl")

        def past(step: int) -> bool:
            return logged() > step

        sb.wait("step 12 (a checkpoint at 10, steps to recompute)", lambda: past(12), timeout=400)
        uids = {n: p["metadata"]["uid"] for n, p in _pods(sb).items()}
        assert sorted(uids) == ["tiny-cpu-a0-n0", "tiny-cpu-a0-n1"]
        _fault(tmp_path, "crash-pod", "tiny-cpu-a0-n1")
        sb.wait("attempt 1 training", lambda: status().get("attempt") == 1
                and status().get("firstStepTime"), timeout=300)  # fmt: skip
        reached = logged()
        checkpoint = max(20, (reached // 10 + 1) * 10)  # attempt 1's first (intervalSteps 10)
        sb.wait("a checkpoint of attempt 1", lambda: past(checkpoint + 2), timeout=400)
        _fault(tmp_path, "kill-pod", "tiny-cpu-a0-n0")
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=600s", timeout=660)  # fmt: skip
        final = status()
        pods = _pods(sb)
    assert {n: p["metadata"]["uid"] for n, p in pods.items()} == uids  # the same pods
    # A failed trainer is reported by its supervisor from the running container: only the
    # killed container was restarted (by the kubelet, once), no container for the crash.
    restarts = {n: p["status"]["containerStatuses"][0]["restartCount"] for n, p in pods.items()}
    assert restarts == {"tiny-cpu-a0-n0": 1, "tiny-cpu-a0-n1": 0}, restarts
    assert final["restarts"] == 2 and final["attempt"] == 2 and final["podAttempt"] == 0
    crash, kill = final["restartHistory"]
    for record in (crash, kill):
        assert record["mode"] == "in-place" and record["reason"] == "PodFailed", record
        assert record["confirmed"] and record["lostSeconds"] > 0, record
        assert record["stepsRecomputed"] is not None, record
    assert crash["fromStep"] >= 10 and kill["fromStep"] >= 20
    assert "tiny-cpu-a0-n1" in crash["message"] and "tiny-cpu-a0-n0" in kill["message"]

    log_path = tmp_path / "runs/job/steps.jsonl"
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["attempt"] for r in records} == {0, 1, 2}
    for attempt, record in ((1, crash), (2, kill)):
        first = min(r["step"] for r in records if r["attempt"] == attempt)
        assert record["fromStep"] == first - 1  # resumed where the status says
    got, want = read_step_log(log_path), uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, RUN_IN_PLACE_STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
    samples = read_step_samples(log_path)
    assert samples == read_step_samples(tmp_path / "runs/ref/steps.jsonl")
    assert all(samples.values())  # every step names its samples


def test_failures_put_their_cause_in_the_status(tmp_path: Path) -> None:
    """A shards url that matches nothing and an s3:// checkpoint without credentials fail
    before any training step, and a learning rate that makes training diverge stops the trainer
    at step 2 with a FloatingPointError: each job's status.message (and Failed condition, and
    Event) carries the cause, not a log line number."""
    jobs: dict[str, tuple[dict[str, Any], str]] = {
        "badurl": (
            {"data": {"sources[0]": {"kind": "shards", "name": "web", "modality": "image",
                                     "url": "data/missing/*.tar"}}},
            "spec.trainer.data.sources[0].url (data/missing/*.tar): FileNotFoundError: source "
            "'web': url 'data/missing/*.tar' matches no .tar shards",
        ),
        "nocreds": (
            {"checkpoint": {"path": "s3://omni-ckpt/nocreds", "intervalSteps": 10}},
            "spec.trainer.checkpoint.path (s3://omni-ckpt/nocreds): NoCredentialsError: Unable "
            "to locate credentials",
        ),
        "diverge": (
            {"optimizer": {"lr": 1e30, "minLr": 1e29}, "lrSchedule": {"warmupSteps": 0}},
            "FloatingPointError: step 2: the gradient norm is nan (loss nan), so the update was "
            "not applied: training diverged; lower optimizer.lr",
        ),
    }  # fmt: skip
    for name, (trainer, _) in jobs.items():
        path = tmp_path / f"{name}.yaml"
        _manifest(path, step_log=f"runs/{name}/steps.jsonl", checkpoint=None)
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["name"] = name
        doc["spec"].update(nodes=1, restartPolicy={"budget": 0})
        doc["spec"]["trainer"]["train"]["steps"] = 3
        for key, value in trainer.items():
            if "sources[0]" in value:
                doc["spec"]["trainer"][key]["sources"][0] = value["sources[0]"]
            else:
                doc["spec"]["trainer"][key] = value
        path.write_text(yaml.safe_dump(doc))
    no_aws = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    none = str(tmp_path / "none")
    no_aws.update(
        AWS_SHARED_CREDENTIALS_FILE=none, AWS_CONFIG_FILE=none, AWS_EC2_METADATA_DISABLED="true"
    )
    with Sandbox(tmp_path, no_aws) as sb:
        for name in jobs:
            sb.kubectl("apply", "-f", f"{name}.yaml")
        for name, (_, cause) in jobs.items():
            sb.wait(f"{name} Failed", lambda n=name: _phase(sb.job(n)) == "Failed", timeout=300)
            status = sb.job(name)["status"]
            assert cause in status["message"], status["message"]
            failed = {c["type"]: c for c in status["conditions"]}["Failed"]
            assert cause in failed["message"]
            selector = f"involvedObject.name={name}"
            events = json.loads(
                sb.kubectl("get", "events", "--field-selector", selector, "-o", "json")
            )
            assert any(cause in e["message"] for e in events["items"] if e["type"] == "Warning")
        for name in ("badurl", "nocreds"):  # before any training step
            assert not (tmp_path / f"runs/{name}/steps.jsonl").exists()
            assert "before the first training step" in sb.job(name)["status"]["message"]
        assert list(read_step_log(tmp_path / "runs/diverge/steps.jsonl")) == [1]


def _phase(job: dict[str, Any]) -> str | None:
    return (job.get("status") or {}).get("phase")


def test_ctrl_c_stops_the_sandbox_quietly(tmp_path: Path) -> None:
    """Every job's reconcile loop returns when kopf asks it to stop: no "Will escalate". And
    the sandbox is gone in less than the 5 s kopf gives the tasks it counts as its own: the API
    server's open connections are not (they end only with the sandbox)."""
    with Sandbox(tmp_path) as sb:
        for name in ("a", "b"):
            path = tmp_path / f"{name}.yaml"
            _manifest(path, step_log=f"runs/{name}.jsonl", checkpoint=None)
            doc = yaml.safe_load(path.read_text())
            doc["metadata"]["name"] = name
            doc["spec"]["suspend"] = True  # a job without pods: its loop sleeps
            path.write_text(yaml.safe_dump(doc))
            sb.kubectl("apply", "-f", path.name)
        sb.wait("Suspended", lambda: _phase(sb.job("b")) == "Suspended", timeout=60)
        assert sb.proc is not None
        sb.proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        assert sb.proc.wait(timeout=60) == 0
        stopping_s = time.monotonic() - signalled
        assert stopping_s < 4.0, f"the sandbox took {stopping_s:.1f} s to stop"
    log = sb.log.read_text()
    assert "Will escalate" not in log and "Traceback" not in log, log


def _corrupt_newest_checkpoint(root: Path) -> int:
    """Flip bytes inside a data file of the newest committed step, keeping its size (what a
    size check cannot see); the step."""
    newest = max(p for p in root.glob("step-*") if (p / "COMMITTED").exists())
    data = max(newest.glob("model/*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(b ^ 0xFF for b in raw[len(raw) // 2 :][:64])
    data.write_bytes(bytes(raw))
    return int(newest.name.removeprefix("step-"))


FRESH_STEPS = 4


def _trainers_started(sb: Sandbox, job: str) -> bool:
    """Every pod of the job's attempt runs its container (the trainers are importing)."""
    pods = [p for p in _pods(sb).values() if p["metadata"]["name"].startswith(f"{job}-a0-n")]
    return len(pods) == 2 and all(
        "running" in ((p.get("status") or {}).get("containerStatuses") or [{}])[0].get("state", {})
        for p in pods
    )


def test_a_restarted_sandbox_keeps_the_job_and_it_succeeds_exactly(tmp_path: Path) -> None:
    """`omni sandbox up` stopped mid-run (API server, kubelet, operator and pods all go) and
    started again on the same --dir: the job is still there, its pods are reported as lost, the
    operator restarts it from its checkpoint, and the loss curve is an uninterrupted run's.
    Meanwhile the newest checkpoint was corrupted in place at the same size: the resume skips it
    for the one before. A second job whose trainers had started but not reached step 1 when the
    sandbox stopped restarts too (infrastructure, not a configuration error) and succeeds. Then
    a job of another name on the same path refuses the checkpoint, naming the owner."""
    steps = RESTARTED_STEPS
    for name, ckpt in (("job", "runs/job/ckpt"), ("ref", None)):
        _manifest(tmp_path / f"{name}.yaml", step_log=f"runs/{name}/steps.jsonl", checkpoint=ckpt)
        doc = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
        doc["spec"]["trainer"]["train"]["steps"] = steps
        if ckpt:
            doc["spec"]["trainer"]["checkpoint"]["intervalSteps"] = 5
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    _manifest(tmp_path / "fresh.yaml", step_log="runs/fresh/steps.jsonl", checkpoint=None,
              steps=FRESH_STEPS)  # fmt: skip
    fresh = yaml.safe_load((tmp_path / "fresh.yaml").read_text())
    fresh["metadata"]["name"] = "fresh"
    (tmp_path / "fresh.yaml").write_text(yaml.safe_dump(fresh))
    with Sandbox(tmp_path) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def checkpointed() -> bool:
            last = (sb.job("tiny-cpu").get("status") or {}).get("lastCheckpoint") or {}
            return (last.get("step") or 0) >= 10  # two: the newest is corrupted below

        sb.wait("two checkpoints", checkpointed, timeout=400)
        sb.kubectl("apply", "-f", "fresh.yaml")  # on the other two nodes
        sb.wait("fresh's trainers started", lambda: _trainers_started(sb, "fresh"), timeout=300)
        assert not (tmp_path / "runs/fresh/steps.jsonl").exists()  # stopped before its step 1
    corrupted = _corrupt_newest_checkpoint(tmp_path / "runs/job/ckpt")
    with Sandbox(tmp_path) as sb:  # the same directory: the stored objects come back
        assert "tiny-cpu" in sb.kubectl("get", "otj")
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "otj/fresh", "--timeout=600s", timeout=660)  # fmt: skip
        fresh = sb.job("fresh")["status"]
        assert fresh["step"] == FRESH_STEPS and fresh["restarts"] == 1, fresh
        assert "previous kubelet" in fresh["restartHistory"][0]["message"], fresh
        status = sb.job("tiny-cpu")["status"]
        assert status["step"] == steps and status["restarts"] == 1
        (restart,) = status["restartHistory"]
        assert "previous kubelet" in restart["message"] and restart["confirmed"]
        pods = json.loads(sb.kubectl("get", "pods", "-o", "json"))["items"]
        names = sorted(p["metadata"]["name"] for p in pods)
        assert names == ["fresh-a1-n0", "fresh-a1-n1", "tiny-cpu-a1-n0", "tiny-cpu-a1-n1"], names
        other = yaml.safe_load((tmp_path / "job.yaml").read_text())
        other["metadata"]["name"] = "other"
        (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
        sb.kubectl("apply", "-f", "other.yaml")
        sb.wait("other Failed", lambda: _phase(sb.job("other")) == "Failed", timeout=300)
        message = sb.job("other")["status"]["message"]
        assert "belongs to job default/tiny-cpu (uid " in message, message
        assert "checkpoint.initFrom" in message
    lines = [json.loads(x) for x in (tmp_path / "runs/job/steps.jsonl").read_text().splitlines()]
    resumed = min(x["step"] for x in lines if x["attempt"] == 1) - 1
    assert restart["fromStep"] == resumed == corrupted - 5 >= 5
    got = read_step_log(tmp_path / "runs/job/steps.jsonl")
    want = uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, steps + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)


def test_credentials_from_a_secret_and_a_shared_claim(tmp_path: Path, moto_endpoint: str) -> None:
    """A job whose checkpoints go to S3 with credentials only in a Secret (`envFrom`), and whose
    step log lives on a PersistentVolumeClaim (`volumes`): it waits in Starting, with the
    kubelet's CreateContainerConfigError in its condition, until the Secret exists, then trains
    and commits its checkpoint to S3. The sandbox itself has no AWS credentials."""
    import boto3

    bucket = "omni-secret-ckpt"
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint}  # fmt: skip
    boto3.client("s3", endpoint_url=moto_endpoint, **_boto(creds)).create_bucket(Bucket=bucket)
    path = tmp_path / "job.yaml"
    _manifest(path, step_log="/shared/steps.jsonl", checkpoint=f"s3://{bucket}/ckpt")
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["trainer"]["train"]["steps"] = 10
    doc["spec"].update(
        envFrom=[{"secretRef": {"name": "s3-credentials"}}],
        volumes=[{"name": "shared", "claimName": "team-a", "mountPath": "/shared"}],
    )
    path.write_text(yaml.safe_dump(doc))
    no_aws = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    none = str(tmp_path / "none")
    no_aws.update(
        AWS_SHARED_CREDENTIALS_FILE=none, AWS_CONFIG_FILE=none, AWS_EC2_METADATA_DISABLED="true"
    )
    with Sandbox(tmp_path, no_aws) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def waiting_for_secret() -> bool:
            conds = {c["type"]: c for c in (sb.job("tiny-cpu").get("status") or {}).get(
                "conditions", [])}  # fmt: skip
            pods_running = conds.get("PodsRunning") or {}
            return 'secret "s3-credentials" not found' in pods_running.get("message", "")

        sb.wait("CreateContainerConfigError in the status", waiting_for_secret, timeout=120)
        assert _phase(sb.job("tiny-cpu")) == "Starting"
        literals = [f"--from-literal={k}={v}" for k, v in creds.items()]
        secret = sb.kubectl("create", "secret", "generic", "s3-credentials", *literals,
                            "--dry-run=client", "-o", "yaml")  # fmt: skip
        (tmp_path / "secret.yaml").write_text(secret)
        sb.kubectl("apply", "-f", "secret.yaml")
        sb.wait("Succeeded", lambda: _phase(sb.job("tiny-cpu")) == "Succeeded", timeout=300)
    keys = boto3.client("s3", endpoint_url=moto_endpoint, **_boto(creds)).list_objects_v2(
        Bucket=bucket, Prefix="ckpt/"
    )
    assert any(o["Key"].endswith("COMMITTED") for o in keys.get("Contents", [])), keys
    claim = tmp_path / SANDBOX_DIR / "claims" / "default" / "team-a" / "steps.jsonl"
    assert list(read_step_log(claim)) == list(range(1, 11))


def _boto(creds: dict[str, str]) -> dict[str, str]:
    return {"aws_access_key_id": creds["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": creds["AWS_SECRET_ACCESS_KEY"],
            "region_name": creds["AWS_DEFAULT_REGION"]}  # fmt: skip
