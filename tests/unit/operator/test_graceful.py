"""Graceful stops on the operator's side: the pods' grace, exit 143, and a restart that waits
for the old pods' emergency checkpoint (pure)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import yaml

from omni_operator.placement import place
from omni_operator.reconcile import Observed, parse_status, reconcile
from omni_operator.recovery.failures import EXIT_STOPPED, classify
from omni_operator.render import render_pod
from omni_operator.spec import OmniTrainingJob, parse_job
from omni_trainer.components.graceful_stop import EXIT_STOPPED as TRAINER_EXIT_STOPPED

from ...conftest import EXAMPLES
from .nodes import node
from .test_start import live

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
T = "2026-12-01T12:00:00Z"
NODES = [node(f"n{i}") for i in range(4)]


def _job(**policy: Any) -> OmniTrainingJob:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="uid-1")
    doc["spec"].update(nodes=2, gpusPerNode=0, restartPolicy=policy)
    return parse_job(doc)


def test_pods_get_the_stop_grace_and_torchrun_forwards_it() -> None:
    job = _job(stopGraceSeconds=200)
    pod = render_pod(job, place(NODES, job.spec).nodes[0], attempt=0)
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNI_STOP_GRACE_SECONDS"] == "200"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "205"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 210
    assert EXIT_STOPPED == TRAINER_EXIT_STOPPED  # one contract, both sides


def _exited(rank: int, code: int) -> dict[str, Any]:
    term = {"exitCode": code, "reason": "Error", "finishedAt": T}
    return {
        "metadata": {"name": f"j-a0-n{rank}", "labels": {"omni.megascale.io/node-rank": str(rank)}},
        "spec": {"nodeName": f"n{rank}"},
        "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": term}}]},
    }


def test_exit_143_is_a_stop_on_request_not_a_crash() -> None:
    nodes = {n["metadata"]["name"]: n for n in NODES}
    kw: dict[str, Any] = dict(spec=_job().spec, now=NOW, last_progress_time=None)
    stopped = classify([_exited(0, 143), _exited(1, 143)], nodes, started_steps=False, **kw)
    assert stopped is not None and stopped.kind == "stopped" and stopped.retryable
    assert stopped.nodes == () and stopped.reason == "GracefulStop"  # no node blamed
    crashed = classify([_exited(0, 143), _exited(1, 1)], nodes, started_steps=True, **kw)
    assert crashed is not None and crashed.kind == "pod_failed"


def test_a_graceful_restart_waits_for_the_old_pods_to_stop() -> None:
    """A pod deleted with grace: the others are deleted too (with their grace), and the next
    attempt starts only once the old pods are gone (they write the emergency checkpoint)."""
    job = _job(backoffSeconds={"base": 0, "max": 0})
    a = reconcile(Observed(job=job, status=parse_status({}), owned=[], nodes=NODES, now=NOW))
    owned = live(a.create, phase="Running")
    status = {**a.status, "phase": "Running"}
    going = [
        {**o, "metadata": {**o["metadata"], "deletionTimestamp": T}}
        if o["metadata"]["name"].endswith("n1")
        else o
        for o in owned
    ]
    b = reconcile(Observed(job=job, status=parse_status(status), owned=going, nodes=NODES, now=NOW))
    assert b.status["phase"] == "Restarting"
    assert b.status["restartHistory"][0]["reason"] == "PodDeleted"
    assert [(d.obj["metadata"]["name"], d.grace_seconds) for d in b.delete] == [
        ("tiny-cpu-a0-n0", None)  # the pod's own grace: time for the emergency checkpoint
    ]
    status = {**status, **b.status}
    later = NOW + dt.timedelta(seconds=5)
    c = reconcile(Observed(job=job, status=parse_status(status), owned=going, nodes=NODES,
                           now=later))  # fmt: skip
    assert not c.create and c.requeue_after == 1.0
    waiting = next(x for x in c.status["conditions"] if x["type"] == "PodsRunning")
    assert waiting["reason"] == "Stopping" and "tiny-cpu-a0-n1" in waiting["message"]
    shared = [o for o in owned if o["kind"] != "Pod"]
    d = reconcile(Observed(job=job, status=parse_status(status), owned=shared, nodes=NODES,
                           now=later))  # fmt: skip
    assert [o["metadata"]["name"] for o in d.create if o["kind"] == "Pod"] == [
        "tiny-cpu-a1-n0",
        "tiny-cpu-a1-n1",
    ]
