"""Stuck starts: what keeps pods from running, start timeouts, images that do not exist, and
what each restart cost (pure)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import yaml

from omni_operator.reconcile import Observed, Progress, parse_status, reconcile
from omni_operator.recovery.failures import classify, next_deadline, start_issues
from omni_operator.spec import OmniTrainingJob, parse_job

from ...conftest import EXAMPLES
from .nodes import node

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
NODES = {f"n{i}": node(f"n{i}") for i in range(4)}
IMAGE = "ghcr.io/megascale-omni/trainer:0.1.0"
NOT_FOUND = (
    f'rpc error: code = NotFound desc = failed to pull and unpack image "{IMAGE}x": failed to '
    f'resolve reference "{IMAGE}x": {IMAGE}x: not found'
)


def _job(**policy: Any) -> OmniTrainingJob:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="uid-1")
    doc["spec"].update(nodes=2, gpusPerNode=0, restartPolicy=policy)
    return parse_job(doc)


def _pending(name: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"omni.megascale.io/node-rank": name[-1]}},
        "spec": {"containers": [{"name": "trainer", "image": IMAGE + "x"}]},
        "status": {"phase": "Pending", **status},
    }


def _waiting(name: str, reason: str, message: str) -> dict[str, Any]:
    waiting = {"waiting": {"reason": reason, "message": message}}
    return _pending(name, containerStatuses=[{"name": "trainer", "state": waiting}])


UNSCHEDULABLE = _pending(
    "j-a0-n0",
    conditions=[
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
        }
    ],
)


def test_start_issues_name_the_schedulers_and_the_kubelets_words() -> None:
    backoff = _waiting("j-a0-n1", "ImagePullBackOff", f'Back-off pulling image "{IMAGE}x"')
    config = _waiting("j-a0-n1", "CreateContainerConfigError", 'secret "s3" not found')
    running = {**UNSCHEDULABLE, "status": {"phase": "Running"}}
    (a, b) = start_issues([UNSCHEDULABLE, backoff, running])
    assert a.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in a.describe()
    assert b.reason == "ImagePullBackOff" and b.image == IMAGE + "x" and not b.terminal
    assert not start_issues([config])[0].terminal  # a Secret may still appear
    assert start_issues([_waiting("p", "ErrImagePull", NOT_FOUND)])[0].terminal
    assert start_issues([_waiting("p", "InvalidImageName", "bad")])[0].terminal
    assert not start_issues([_waiting("p", "ErrImagePull", "i/o timeout")])[0].terminal


def test_a_missing_image_fails_at_once_naming_it() -> None:
    pods = [_waiting("j-a0-n0", "ErrImagePull", NOT_FOUND), UNSCHEDULABLE]
    failure = classify(pods, NODES, spec=_job().spec, now=NOW, last_progress_time=None,
                       started_steps=False, starting_since=NOW)  # fmt: skip
    assert failure is not None and failure.kind == "image_pull_failed" and not failure.retryable
    assert f"image {IMAGE}x cannot be pulled" in failure.message and "not found" in failure.message


def test_transient_start_issues_wait_for_the_start_timeout() -> None:
    spec = _job(startTimeoutSeconds=300).spec
    pods = [_waiting("j-a0-n1", "ErrImagePull", "dial tcp: i/o timeout"), UNSCHEDULABLE]
    kw: dict[str, Any] = dict(spec=spec, now=NOW, last_progress_time=None, started_steps=False)
    assert classify(pods, NODES, starting_since=NOW - dt.timedelta(seconds=299), **kw) is None
    assert next_deadline(pods, NODES, spec=spec, now=NOW, last_progress_time=None,
                         starting_since=NOW - dt.timedelta(seconds=200)) == 100  # fmt: skip
    failure = classify(pods, NODES, starting_since=NOW - dt.timedelta(seconds=301), **kw)
    assert failure is not None and failure.kind == "start_timeout" and failure.retryable
    assert "startTimeoutSeconds 300" in failure.message
    assert "ErrImagePull" in failure.message and "Insufficient nvidia.com/gpu" in failure.message


def _obs(job: OmniTrainingJob, status: dict[str, Any], owned: list, **kw: Any) -> Observed:
    kw.setdefault("now", NOW)
    return Observed(job=job, status=parse_status(status), owned=owned, nodes=list(NODES.values()),
                    **kw)  # fmt: skip


def live(objs: list[dict], **pod_status: Any) -> list[dict]:
    """Created objects as the API returns them, pods with this status."""
    return [
        {**o, "metadata": {**o["metadata"], "uid": "x"}, "status": pod_status}
        if o["kind"] == "Pod"
        else o
        for o in objs
    ]


def test_starting_until_every_trainer_runs_then_restart_costed_at_the_first_step() -> None:
    """Starting names the scheduler's message; Running once all pods run; the first step after
    a restart writes lostSeconds into that restart's record, and its stepsRecomputed is the
    failed attempt's last step beyond the checkpoint."""
    job = _job(startTimeoutSeconds=600, backoffSeconds={"base": 0, "max": 0})
    a = reconcile(_obs(job, {}, []))
    status = a.status
    assert status["phase"] == "Starting"
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available"}  # fmt: skip
    owned = live(a.create, phase="Pending", conditions=[cond])
    b = reconcile(_obs(job, status, owned, tracks_progress=True))
    status = {**status, **b.status}
    running = next(c for c in status["conditions"] if c["type"] == "PodsRunning")
    assert status["phase"] == "Starting" and running["reason"] == "Unschedulable"
    assert "0/4 nodes are available" in running["message"]

    owned = live(a.create, phase="Running")
    progress = Progress(step=30, checkpoint_step=20)
    c = reconcile(_obs(job, status, owned, tracks_progress=True, progress=progress))
    status = {**status, **c.status}
    assert status["phase"] == "Running" and status["firstStepTime"]

    crashed = [{**o, "status": {"phase": "Failed"}} if o["kind"] == "Pod" else o for o in owned]
    d = reconcile(_obs(job, status, crashed, tracks_progress=True))
    status = {**status, **d.status}
    (record,) = status["restartHistory"]
    assert record["mode"] == "recreate" and record["fromStep"] == 20
    assert record["stepsRecomputed"] == 10 and record["lostSeconds"] is None

    later = NOW + dt.timedelta(seconds=42)
    e = reconcile(_obs(job, status, [o for o in owned if o["kind"] != "Pod"], now=later,
                       tracks_progress=True))  # fmt: skip
    status = {**status, **e.status}
    assert status["phase"] == "Starting" and status["attempt"] == 1
    new = live([o for o in e.create if o["kind"] == "Pod"], phase="Running")
    shared = [o for o in owned if o["kind"] != "Pod"]
    f = reconcile(_obs(job, status, shared + new, now=later + dt.timedelta(seconds=8),
                       tracks_progress=True, progress=Progress(step=21)))  # fmt: skip
    status = {**status, **f.status}
    assert status["restartHistory"][0]["lostSeconds"] == 50  # detection -> first step


def test_start_timeout_restarts_and_a_missing_image_fails() -> None:
    job = _job(startTimeoutSeconds=60)
    a = reconcile(_obs(job, {}, []))
    backoff = {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}
    pulling = live(a.create, phase="Pending", containerStatuses=[{"state": backoff}])
    b = reconcile(_obs(job, a.status, pulling, now=NOW + dt.timedelta(seconds=30)))
    assert b.status.get("phase") is None and b.requeue_after == 30  # still within the timeout
    c = reconcile(_obs(job, a.status, pulling, now=NOW + dt.timedelta(seconds=61)))
    assert c.status["phase"] == "Restarting"
    assert c.status["restartHistory"][0]["reason"] == "StartTimeout"

    pull = {"waiting": {"reason": "ErrImagePull", "message": NOT_FOUND}}
    missing = live(a.create, phase="Pending", containerStatuses=[{"state": pull}])
    d = reconcile(_obs(job, a.status, missing, now=NOW + dt.timedelta(seconds=1)))
    assert d.status["phase"] == "Failed" and "cannot be pulled" in d.status["message"]
    failed = next(x for x in d.status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "ImagePullFailed" and IMAGE in failed["message"]
