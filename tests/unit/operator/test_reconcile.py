"""Desired vs actual, conditions and phase transitions (pure)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import yaml

from omni_operator import kube_objects
from omni_operator.reconcile import (
    Observed,
    Progress,
    diff,
    parse_status,
    reconcile,
    set_condition,
    status_patch,
)
from omni_operator.recovery import failures
from omni_operator.render import ANNOTATION_ORDER, LABEL_ATTEMPT
from omni_operator.sandbox.testbed import job_manifest
from omni_operator.spec import OmniTrainingJob, parse_job
from omni_operator.status import Condition, OmniTrainingJobStatus, RestartRecord

from ...conftest import EXAMPLES
from .nodes import node

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
T = "2026-12-01T12:00:00Z"


def _job(**spec: Any) -> OmniTrainingJob:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="uid-1")
    doc["spec"].update(nodes=2, gpusPerNode=0, **spec)
    return parse_job(doc)


NODES = [node(f"n{i}") for i in range(4)]


def _obs(job: OmniTrainingJob, status: dict | None = None, owned=(), **kw: Any) -> Observed:
    kw.setdefault("nodes", NODES)
    kw.setdefault("now", NOW)
    return Observed(job=job, status=parse_status(status), owned=list(owned), **kw)


def _live(objs: list[dict], phase: str = "Running") -> list[dict]:
    """Created objects as the API returns them, pods in ``phase``."""
    out = []
    for o in objs:
        o = {**o, "metadata": {**o["metadata"], "uid": "x"}}
        if o["kind"] == "Pod":
            node_name = o["metadata"]["annotations"]["omni.megascale.io/placed-node"]
            o = {**o, "spec": {**o["spec"], "nodeName": node_name}, "status": {"phase": phase}}
        out.append(o)
    return out


def _start(job: OmniTrainingJob) -> tuple[dict, list[dict]]:
    """A job whose attempt 0 is running: (status, owned objects)."""
    a = reconcile(_obs(job))
    return a.status, _live(a.create)


def _cond(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_diff_creates_adopts_and_prunes_by_name() -> None:
    desired = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p1", "labels": {"a": "b"}, "ownerReferences": [{"uid": "u"}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p2", "ownerReferences": [{"uid": "u"}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p3", "ownerReferences": [{"uid": "u"}]},
        },
    ]
    existing = [
        {"kind": "Pod", "metadata": {"name": "p1"}},  # ours by name, no owner: adopt
        {"kind": "Pod", "metadata": {"name": "p2", "ownerReferences": [{"uid": "u"}]}},
        {"kind": "Pod", "metadata": {"name": "p3", "deletionTimestamp": T}},  # still going
        {"kind": "Pod", "metadata": {"name": "old"}},
        {"kind": "ConfigMap", "metadata": {"name": "cm"}},  # not pruned by kind
    ]
    d = diff(desired, existing)
    assert [o["metadata"]["name"] for o in d.create] == []
    assert [o["metadata"]["name"] for o in d.adopt] == ["p1"]
    assert d.adopt[0]["metadata"]["ownerReferences"] == [{"uid": "u"}]
    assert [o["metadata"]["name"] for o in d.waiting] == ["p3"]
    assert [o["metadata"]["name"] for o in d.delete] == ["old"]
    assert [o["metadata"]["name"] for o in diff(desired, []).create] == ["p1", "p2", "p3"]


def test_set_condition_is_idempotent_and_moves_time_only_on_status_change() -> None:
    c = set_condition([], type="Placed", status="True", reason="Placed", now="t1")
    assert set_condition(c, type="Placed", status="True", reason="Placed", now="t2") == c
    c2 = set_condition(c, type="Placed", status="True", reason="Other", message="m", now="t2")
    assert c2[0].last_transition_time == "t1" and c2[0].reason == "Other"
    c3 = set_condition(c2, type="Placed", status="False", reason="Unschedulable", now="t3")
    assert c3[0].last_transition_time == "t3"
    c4 = set_condition(c3, type="Valid", status="True", reason="SpecValid", now="t4")
    assert [x.type for x in c4] == ["Placed", "Valid"]


def test_status_patch_has_only_changes_and_full_first_write() -> None:
    old = OmniTrainingJobStatus(phase="Running", step=5)
    new = old.model_copy(update={"step": 6})
    assert status_patch(old, new) == {"step": 6}
    assert status_patch(OmniTrainingJobStatus(), new, full=True)["restarts"] == 0
    assert parse_status({"phase": "Bogus"}) == OmniTrainingJobStatus()
    assert parse_status({"phase": "Running", "unknownField": 1}).phase == "Running"


def test_first_reconcile_creates_everything_and_starts() -> None:
    a = reconcile(_obs(_job()))
    kinds = [o["kind"] for o in a.create]
    assert kinds == ["ConfigMap", "Service", "Service", "Pod", "Pod"]
    assert a.status["phase"] == "Starting" and a.status["placement"] == ["n0", "n1"]
    assert a.status["attemptStartTime"] == T
    assert a.status["restartBudgetLeft"] == 10 and a.status["startTime"] == T
    assert _cond(a.status, "Placed")["status"] == "True"
    assert [e.reason for e in a.events] == ["PodsCreated"]


def test_multi_node_gpu_job_states_its_inter_node_transport() -> None:
    """Condition InterNodeRDMA: TCP sockets named with the field to set, never silent."""
    tcp = _cond(reconcile(_obs(parse_job(job_manifest()))).status, "InterNodeRDMA")
    assert (tcp["status"], tcp["reason"]) == ("False", "TCPSockets")
    assert (
        tcp["message"].startswith("spec.resources.rdma: ") and "NCCL_IB_DISABLE=1" in tcp["message"]
    )
    ib = _cond(
        reconcile(_obs(parse_job(job_manifest(resources={"rdma": {"count": 2}})))).status,
        "InterNodeRDMA",
    )
    assert (ib["status"], ib["reason"], ib["message"]) == ("True", "RDMA", "2 rdma/ib per pod")
    chosen = parse_job(job_manifest(nccl={"env": {"NCCL_IB_DISABLE": "1"}}))
    said = _cond(reconcile(_obs(chosen)).status, "InterNodeRDMA")
    assert (said["status"], said["message"]) == ("False", "nccl.env sets NCCL_IB_DISABLE")
    cpu = reconcile(_obs(_job())).status  # CPU pods: no NCCL
    assert all(c["type"] != "InterNodeRDMA" for c in cpu["conditions"])


def test_reconcile_is_idempotent_once_running() -> None:
    job = _job()
    status, owned = _start(job)
    a = reconcile(_obs(job, status, owned))
    assert not a.create and not a.delete and not a.events
    assert set(a.status) <= {"conditions", "phase", "message"}  # PodsRunning True: Running
    assert a.status["phase"] == "Running"
    status = {**status, **a.status}
    again = reconcile(_obs(job, status, owned))
    assert again.status == {} and not again.events


def test_partial_creation_is_completed_not_restarted() -> None:
    job = _job()
    first = reconcile(_obs(job))
    owned = _live(first.create[:4], phase="Pending")  # stopped before the 2nd pod and status
    a = reconcile(_obs(job, None, owned))
    assert [o["metadata"]["name"] for o in a.create] == ["tiny-cpu-a0-n1"]
    assert a.status["phase"] == "Starting" and not a.delete


def test_unplaceable_job_waits_in_placing() -> None:
    a = reconcile(_obs(_job(), nodes=[node("n0")]))
    assert a.status["phase"] == "Placing" and not a.create
    assert _cond(a.status, "Placed")["reason"] == "Unschedulable"
    assert a.events[0].type == "Warning" and "cannot place 2 nodes" in a.events[0].message


def test_failure_restarts_after_backoff_on_new_nodes() -> None:
    job = _job(restartPolicy={"backoffSeconds": {"base": 30, "max": 60}})
    status, owned = _start(job)
    owned = [
        o if o["metadata"]["name"] != "tiny-cpu-a0-n1" else {**o, "status": {"phase": "Failed"}}
        for o in owned
    ]
    a = reconcile(_obs(job, status, owned))
    assert a.status["phase"] == "Restarting" and a.status["attempt"] == 1
    assert a.requeue_after == 30 and {d.obj["metadata"]["name"] for d in a.delete} == {
        "tiny-cpu-a0-n0",
        "tiny-cpu-a0-n1",
    }
    assert a.events[0].reason == "PodFailed" and a.events[0].type == "Warning"
    status = {**status, **a.status}
    early = reconcile(_obs(job, status, owned, now=NOW + dt.timedelta(seconds=10)))
    assert not early.create and early.requeue_after == 20
    remaining = [o for o in owned if o["kind"] != "Pod"]
    due = reconcile(_obs(job, status, remaining, now=NOW + dt.timedelta(seconds=31)))
    pods = [o for o in due.create if o["kind"] == "Pod"]
    assert [p["metadata"]["labels"][LABEL_ATTEMPT] for p in pods] == ["1", "1"]
    assert due.status["phase"] == "Starting"


def test_pods_on_a_lost_node_are_force_deleted() -> None:
    job = _job(restartPolicy={"nodeLostGraceSeconds": 5})
    status, owned = _start(job)
    nodes = [node("n0"), node("n1", ready=False), node("n2"), node("n3")]
    a = reconcile(_obs(job, status, owned, nodes=nodes))
    grace = {d.obj["metadata"]["name"]: d.grace_seconds for d in a.delete}
    assert grace == {"tiny-cpu-a0-n0": None, "tiny-cpu-a0-n1": 0}
    assert a.status["restartHistory"][0]["reason"] == "NodeLost"


def test_non_retryable_failure_fails_and_stops_the_rest() -> None:
    job = _job(restartPolicy={"nonRetryableExitCodes": [2]})
    status, owned = _start(job)
    term = {"terminated": {"exitCode": 2, "finishedAt": T}}
    owned[3] = {**owned[3], "status": {"phase": "Failed", "containerStatuses": [{"state": term}]}}
    a = reconcile(_obs(job, status, owned))
    assert a.status["phase"] == "Failed" and a.status["completionTime"] == T
    assert [d.obj["metadata"]["name"] for d in a.delete] == ["tiny-cpu-a0-n1"]
    assert _cond(a.status, "Failed")["reason"] == "UserError"
    assert reconcile(_obs(job, {**status, **a.status}, owned)).status == {}  # terminal


def test_all_pods_succeeded() -> None:
    job = _job()
    status, owned = _start(job)
    owned = [{**o, "status": {"phase": "Succeeded"}} if o["kind"] == "Pod" else o for o in owned]
    a = reconcile(_obs(job, status, owned))
    assert a.status["phase"] == "Succeeded" and _cond(a.status, "Complete")["status"] == "True"


def _succeeded(owned: list[dict], final: str) -> list[dict]:
    """The job's objects with every pod Succeeded, ``final`` as each one's termination message."""
    term = {"terminated": {"exitCode": 0, "finishedAt": T, "message": final}}
    return [
        {**o, "status": {"phase": "Succeeded", "containerStatuses": [{"state": term}]}}
        if o["kind"] == "Pod"
        else o
        for o in owned
    ]


def test_success_takes_the_trainers_final_figures() -> None:
    """Scrapes lag: after Succeeded, status holds rank 0's final report (its termination
    message), printed as the logs print them, and the last checkpoint gets its Event."""
    job = _job()
    status, owned = _start(job)
    p = Progress(step=145, checkpoint_step=140, tokens_per_second=5135.989290305005, mfu=0.1)
    status = {**status, **reconcile(_obs(job, status, owned, progress=p)).status}
    final = '{"step": 150, "tokensPerSecond": 5201.4, "mfu": 0.11126, "checkpointStep": 150}'
    done = _succeeded(owned, final)
    a = reconcile(_obs(job, status, done, progress=None))
    assert a.status["phase"] == "Succeeded" and a.status["step"] == 150
    assert a.status["tokensPerSecond"] == 5201 and a.status["mfuPercent"] == "11.13%"
    assert a.status["lastCheckpoint"]["step"] == 150
    assert [e.message for e in a.events if e.reason == "Checkpoint"] == [
        "checkpoint at step 150 complete"
    ]


def test_the_restart_record_takes_the_step_the_trainer_resumed_from() -> None:
    """The operator restarts from the latest checkpoint it saw (35); the trainer resumed from
    the latest in storage (45): the record and an Event say 45, once."""
    job = _job(restartPolicy={"backoffSeconds": {"base": 0, "max": 0}})
    status, owned = _start(job)
    seen = reconcile(_obs(job, status, owned, progress=Progress(step=40, checkpoint_step=35)))
    status = {**status, **seen.status}
    failed = [
        {**o, "status": {"phase": "Failed"}} if o["metadata"]["name"] == "tiny-cpu-a0-n1" else o
        for o in owned
    ]
    restart = reconcile(_obs(job, status, failed))
    status = {**status, **restart.status}
    assert status["restartHistory"][-1]["fromStep"] == 35
    shared = [o for o in owned if o["kind"] != "Pod"]
    attempt1 = reconcile(_obs(job, status, shared))
    status = {**status, **attempt1.status}
    running = _live([o for o in attempt1.create if o["kind"] == "Pod"])
    assert status["attempt"] == 1 and len(running) == 2
    loaded = reconcile(_obs(job, status, shared + running, progress=Progress(resumed_from=45)))
    assert loaded.status["step"] == 45  # at once, not the failed attempt's 40 until step 46
    p = Progress(step=46, resumed_from=45)
    a = reconcile(_obs(job, status, shared + running, progress=p))
    record = a.status["restartHistory"][-1]
    assert record["fromStep"] == 45 and record["confirmed"] and record["attempt"] == 1
    assert a.status["lastCheckpoint"]["step"] == 45
    (event,) = [e for e in a.events if e.reason == "ResumedFrom"]
    assert event.message == "attempt 1 resumed from checkpoint step 45 (planned: 35)"
    again = reconcile(_obs(job, {**status, **a.status}, shared + running, progress=p))
    assert "restartHistory" not in again.status and not again.events


def test_suspend_then_resume_as_a_new_attempt() -> None:
    job = _job()
    status, owned = _start(job)
    a = reconcile(_obs(_job(suspend=True), status, owned))
    assert a.status["phase"] == "Suspended" and len(a.delete) == 2 and not a.create
    status = {**status, **a.status}
    shared = [o for o in owned if o["kind"] != "Pod"]
    b = reconcile(_obs(job, status, shared))
    assert b.status["attempt"] == 1 and b.status["phase"] == "Starting"
    assert {e.reason for e in b.events} == {"Resumed", "PodsCreated"}


def test_a_resume_whose_status_write_conflicted_adopts_the_pods_it_created() -> None:
    """The resume creates attempt 1's pods, then its conditional status write meets a newer job
    (409): the re-run reads the Suspended status of attempt 0 beside attempt 1's pods. It must
    adopt them, not delete them as strays (which failed the resumed attempt at once)."""
    job = _job()
    status, owned = _start(job)
    status = {**status, **reconcile(_obs(_job(suspend=True), status, owned)).status}
    shared = [o for o in owned if o["kind"] != "Pod"]
    resumed = reconcile(_obs(job, status, shared))
    assert [d.obj["metadata"]["name"] for d in resumed.delete] == ["tiny-cpu-a0-rdzv"]
    shared = [o for o in shared if o["metadata"]["name"] != "tiny-cpu-a0-rdzv"]
    shared += [o for o in resumed.create if o["kind"] != "Pod"]  # attempt 1's rendezvous
    new_pods = _live([o for o in resumed.create if o["kind"] == "Pod"])
    rerun = reconcile(_obs(job, status, shared + new_pods))  # the write did not land
    assert not rerun.delete, [d.obj["metadata"]["name"] for d in rerun.delete]
    assert rerun.status["attempt"] == 1 and not [o for o in rerun.create if o["kind"] == "Pod"]
    again = reconcile(_obs(_job(suspend=True), status, shared + new_pods))  # suspended again
    assert {d.obj["metadata"]["name"] for d in again.delete} == {
        p["metadata"]["name"] for p in new_pods
    }


def test_progress_updates_status_and_refills_the_budget() -> None:
    job = _job(restartPolicy={"budget": 3})
    status, owned = _start(job)
    status["restartBudgetLeft"] = 1
    p = Progress(step=50, checkpoint_step=40, checkpoint_path="s3://b/40", mfu=0.4)
    a = reconcile(_obs(job, status, owned, progress=p, tracks_progress=True))
    assert a.status["step"] == 50 and a.status["lastCheckpoint"]["step"] == 40
    assert a.status["restartBudgetLeft"] == 3 and a.status["lastProgressTime"] == T
    assert a.status["mfu"] == 0.4 and a.status["mfuPercent"] == "40.00%"
    assert [e.reason for e in a.events] == ["Checkpoint"]


def test_quarantined_nodes_are_avoided_when_placing() -> None:
    status = OmniTrainingJobStatus(
        phase="Restarting",
        attempt=1,
        quarantined_nodes=["n0"],
        restart_history=[RestartRecord(attempt=1, reason="NodeLost", time=T, nodes=["n0"])],
        conditions=[Condition(type="Valid", status="True", reason="SpecValid")],
    ).model_dump(mode="json", by_alias=True)
    a = reconcile(_obs(_job(), status))
    assert a.status["placement"] == ["n1", "n2"]


def _crashed(pod: dict, *, attempt: int, finished: str = T) -> dict:
    """``pod`` (Running) whose container the kubelet restarted after the supervisor exited for
    ``attempt`` (its termination message tagged so)."""
    message = f"[attempt {attempt}] rank 1: RuntimeError: boom"
    last = {"terminated": {"exitCode": 1, "finishedAt": finished, "message": message}}
    cs = {"name": "trainer", "restartCount": 1, "state": {"running": {}}, "lastState": last}
    return {**pod, "status": {"phase": "Running", "containerStatuses": [cs]}}


def test_a_crashed_trainer_restarts_in_place_in_the_same_pods() -> None:
    """A container that ended in the current attempt (the kubelet already restarted it): no pod
    is deleted; after the backoff each pod's order annotation names the new attempt for the
    same pods (the ConfigMap too, for pods rendered before the annotation), and
    the old failure, still in lastState, does not count against the new attempt."""
    job = _job(restartPolicy={"backoffSeconds": {"base": 0, "max": 0}})
    status, owned = _start(job)
    status = {**status, **reconcile(_obs(job, status, owned, progress=Progress(step=7))).status}
    owned = [_crashed(o, attempt=0) if o["metadata"]["name"] == "tiny-cpu-a0-n1" else o
             for o in owned]  # fmt: skip
    a = reconcile(_obs(job, status, owned, progress=Progress(step=7, attempt=0)))
    assert not a.delete and not a.create and a.status["phase"] == "Restarting"
    assert a.status["attempt"] == 1 and a.status["podAttempt"] == 0
    record = a.status["restartHistory"][-1]
    assert (record["mode"], record["reason"], record["stepsRecomputed"]) == (
        "in-place",
        "PodFailed",
        7,
    )
    assert "restarting in place as attempt 1" in a.status["message"]
    assert "RuntimeError: boom" in record["message"] and "[attempt" not in record["message"]
    status = {**status, **a.status}

    later = NOW + dt.timedelta(seconds=2)
    b = reconcile(_obs(job, status, owned, now=later))
    orders = {p["metadata"]["name"]: p for p in b.adopt if p["kind"] == "Pod"}
    assert sorted(orders) == ["tiny-cpu-a0-n0", "tiny-cpu-a0-n1"]  # each pod's own order
    for patch in orders.values():
        order = patch["metadata"]["annotations"][ANNOTATION_ORDER]
        assert json.loads(order) == {"attempt": 1, "pods": 0}
        assert set(patch["metadata"]) == {"name", "namespace", "annotations"}  # nothing else
    (config,) = [p for p in b.adopt if p["kind"] == "ConfigMap"]  # pods of older versions
    assert json.loads(config["data"]["attempt"]) == {"attempt": 1, "pods": 0}
    assert len(b.adopt) == 3
    assert not b.create and not b.delete and b.status["phase"] == "Starting"
    assert [e.reason for e in b.events] == ["RestartingInPlace"]
    status = {**status, **b.status}

    # The old trainer still answers (attempt 0): not this attempt's progress; then attempt 1's.
    c = reconcile(_obs(job, status, owned, now=later, progress=Progress(step=9, attempt=0)))
    assert c.status["phase"] == "Running" and "firstStepTime" not in c.status
    status = {**status, **c.status}
    d = reconcile(_obs(job, status, owned, now=later + dt.timedelta(seconds=3),
                       progress=Progress(step=6, attempt=1, resumed_from=5)))  # fmt: skip
    assert not d.delete and "phase" not in d.status
    record = d.status["restartHistory"][-1]
    assert record["lostSeconds"] == 5 and record["fromStep"] == 5 and record["stepsRecomputed"] == 2

    # The same pod crashes again in attempt 1: a new failure (its tag is current).
    again = [_crashed(o, attempt=1) if o["metadata"]["name"] == "tiny-cpu-a0-n0" else o
             for o in owned]  # fmt: skip
    e = reconcile(_obs(job, {**status, **d.status}, again, now=later + dt.timedelta(seconds=9)))
    assert e.status["attempt"] == 2 and e.status["restartHistory"][-1]["mode"] == "in-place"


def _unready(pod: dict) -> dict:
    """``pod`` running, its container unready (its supervisor reports a failed attempt)."""
    cs = {"name": "trainer", "ready": False, "restartCount": 0, "state": {"running": {}}}
    return {**pod, "status": {"phase": "Running", "podIP": "10.0.0.7", "containerStatuses": [cs]}}


def test_a_failure_the_supervisor_reports_restarts_in_place_like_a_container_end() -> None:
    """The container runs on, unready; its supervisor's report (read by the operator) is this
    attempt's failure: same classification, exit code and message as a termination; restarted
    in place with no pod deleted. A report tagged with an older attempt is an echo."""
    job = _job(restartPolicy={"backoffSeconds": {"base": 0, "max": 0},
                              "nonRetryableExitCodes": [3]})  # fmt: skip
    status, owned = _start(job)
    status = {**status, **reconcile(_obs(job, status, owned, progress=Progress(step=7))).status}
    owned = [_unready(o) if o["metadata"]["name"] == "tiny-cpu-a0-n1" else o for o in owned]
    assert "phase" not in reconcile(_obs(job, status, owned)).status  # unready alone: nothing
    report = {"attempt": 0, "exitCode": 1, "reason": "Error", "finishedAt": T,
              "message": "[attempt 0] rank 1: RuntimeError: boom"}  # fmt: skip
    seen = failures.with_reports(owned, {"tiny-cpu-a0-n1": report})
    a = reconcile(_obs(job, status, seen, progress=Progress(step=7, attempt=0)))
    assert not a.delete and not a.create and a.status["phase"] == "Restarting"
    record = a.status["restartHistory"][-1]
    assert (record["mode"], record["reason"]) == ("in-place", "PodFailed")
    assert "RuntimeError: boom" in record["message"] and "[attempt" not in record["message"]
    status = {**status, **a.status}
    echo = reconcile(_obs(job, status, seen, now=NOW + dt.timedelta(seconds=2)))
    assert echo.status.get("attempt", 1) == 1 and echo.status["phase"] == "Starting"
    # An exit code the policy lists is as final when reported as when the container ends.
    bad = {**report, "exitCode": 3, "message": "[attempt 1] bad config"}
    fatal = failures.with_reports(owned, {"tiny-cpu-a0-n1": bad})
    b = reconcile(_obs(job, {**status, **echo.status}, fatal, now=NOW + dt.timedelta(seconds=3)))
    assert b.status["phase"] == "Failed" and "exited with code 3" in b.status["message"]


def test_in_place_falls_back_to_recreate_when_pods_are_gone_or_policy_says_so() -> None:
    for spec, pod_phase in (({}, "Failed"), ({"mode": "recreate"}, "Running")):
        job = _job(restartPolicy={"backoffSeconds": {"base": 0, "max": 0}, **spec})
        status, owned = _start(job)
        owned = [
            {**_crashed(o, attempt=0), "status": {**_crashed(o, attempt=0)["status"],
                                                  "phase": pod_phase}}
            if o["metadata"]["name"] == "tiny-cpu-a0-n1" else o
            for o in owned
        ]  # fmt: skip
        if pod_phase == "Running":  # a Never pod reports its end in state, not lastState
            cs = owned[-1]["status"]["containerStatuses"][0]
            cs["state"], cs["lastState"] = cs["lastState"], {}
        a = reconcile(_obs(job, status, owned))
        assert a.status["restartHistory"][-1]["mode"] == "recreate", spec
        assert len(a.delete) == 2 and a.status.get("podAttempt") is None


def test_a_container_death_before_the_attempt_is_not_its_failure() -> None:
    """An untagged termination (the whole container was killed) in a kept pod that ended no
    later than the attempt's start belongs to an earlier attempt, also in the start's own
    second (timestamps have whole seconds; counting it restarted the job again for the same
    kill), both while the kubelet has not restarted the container yet (``state``) and after
    (``lastState``). One a second later is this attempt's."""
    job = _job()
    status, owned = _start(job)
    status = {**status, "attempt": 1, "podAttempt": 0, "attemptStartTime": T}
    before, after = "2026-12-01T11:59:58Z", "2026-12-01T12:00:01Z"
    assert T == "2026-12-01T12:00:00Z"
    for key in ("lastState", "state"):
        for finished, restarts in ((before, False), (T, False), (after, True)):
            pods = [_crashed(o, attempt=0, finished=finished) if o["kind"] == "Pod" else o
                    for o in owned]  # fmt: skip
            for p in pods:
                if p["kind"] == "Pod":
                    cs = p["status"]["containerStatuses"][0]
                    last = cs["lastState"]["terminated"]
                    last["message"], last["exitCode"] = "", 137
                    if key == "state":
                        cs["state"], cs["lastState"] = cs["lastState"], {}
            a = reconcile(_obs(job, status, pods, progress=Progress(step=3)))
            assert (a.status.get("phase") == "Restarting") is restarts, (key, finished, a.status)


def test_a_slow_start_is_the_start_timeout_s_business_not_a_hang() -> None:
    """Running pods whose trainers have not reached their first step (imports, rendezvous of
    a restart on a busy node) are not hung; the start timeout bounds them. After the first
    step, no progress for hangTimeoutSeconds is a hang."""
    job = _job(restartPolicy={"hangTimeoutSeconds": 60, "startTimeoutSeconds": 300})
    status, owned = _start(job)
    status = {**status, **reconcile(_obs(job, status, owned, tracks_progress=True)).status}
    slow = reconcile(_obs(job, status, owned, tracks_progress=True,
                          now=NOW + dt.timedelta(seconds=120)))  # fmt: skip
    assert slow.status.get("phase") != "Restarting" and slow.requeue_after == 180
    later = NOW + dt.timedelta(seconds=130)
    p = Progress(step=1, attempt=0)
    status = {**status, **reconcile(_obs(job, status, owned, tracks_progress=True,
                                         now=later, progress=p)).status}  # fmt: skip
    hung = reconcile(_obs(job, status, owned, tracks_progress=True, progress=p,
                          now=later + dt.timedelta(seconds=61)))  # fmt: skip
    assert hung.status["phase"] == "Restarting"
    assert hung.status["restartHistory"][-1]["reason"] == "Hang"


def test_a_restart_whose_attempt_ends_between_polls_is_costed_from_the_final_report() -> None:
    """No scrape saw attempt 1's first step (it trained and finished between two polls): the
    final report says how long before the end its first step finished, which costs the restart
    and confirms where it resumed."""
    job = _job(restartPolicy={"backoffSeconds": {"base": 0, "max": 0}})
    status, owned = _start(job)
    status = {**status, **reconcile(_obs(job, status, owned, progress=Progress(step=7))).status}
    owned = [_crashed(o, attempt=0) if o["metadata"]["name"] == "tiny-cpu-a0-n1" else o
             for o in owned]  # fmt: skip
    status = {**status, **reconcile(_obs(job, status, owned, progress=Progress(step=7))).status}
    later = NOW + dt.timedelta(seconds=2)
    status = {**status, **reconcile(_obs(job, status, owned, now=later)).status}
    assert status["attempt"] == 1 and status.get("firstStepTime") is None
    final = '{"step": 150, "resumedFrom": 5, "checkpointStep": 150, "sinceFirstStepSeconds": 15}'
    done = _succeeded(owned, final)
    end = NOW + dt.timedelta(seconds=22)
    a = reconcile(_obs(job, status, done, now=end, progress=None))
    assert a.status["phase"] == "Succeeded"
    record = a.status["restartHistory"][-1]
    assert record["lostSeconds"] == 7  # detected at NOW, first step at end - 15 s
    assert record["confirmed"] and record["fromStep"] == 5


def _backing_off(pod: dict, *, delay: str) -> dict:
    """``pod`` (:func:`_crashed`) whose container waits in CrashLoopBackOff for ``delay``."""
    cs = pod["status"]["containerStatuses"][0]
    message = f"back-off {delay} restarting failed container=trainer pod=x"
    waiting = {"reason": "CrashLoopBackOff", "message": message}
    return {**pod, "status": {**pod["status"], "containerStatuses": [
        {**cs, "state": {"waiting": waiting}}]}}  # fmt: skip


def test_an_in_place_restart_recreates_the_pods_over_a_long_crash_back_off() -> None:
    """The kubelet backs a container that crashed again within 10 minutes off for 10 s, 20 s,
    ... 5 min: when one would wait longer than new pods take, the restart recreates the pods
    (no back-off) and says so; a short back-off still restarts in place."""
    assert kube_objects.go_duration_seconds("5m0s") == 300
    assert (
        kube_objects.go_duration_seconds("1m20s") == 80
        and kube_objects.go_duration_seconds("40s") == 40
    )
    assert kube_objects.go_duration_seconds("soon") is None
    job = _job(restartPolicy={"backoffSeconds": {"base": 0, "max": 0}})
    status, owned = _start(job)
    crashed = [_crashed(o, attempt=0) if o["metadata"]["name"] == "tiny-cpu-a0-n1" else o
               for o in owned]  # fmt: skip
    a = reconcile(_obs(job, status, crashed, progress=Progress(step=7, attempt=0)))
    status = {**status, **a.status}
    assert a.status["restartHistory"][-1]["mode"] == "in-place"

    for delay, left, in_place in (("20s", 8.0, True), ("1m20s", 68.0, False)):
        owned = [_backing_off(o, delay=delay) if o["metadata"]["name"] ==
                 "tiny-cpu-a0-n1" else o for o in crashed]  # fmt: skip
        pod = next(o for o in owned if o["metadata"]["name"] == "tiny-cpu-a0-n1")
        assert kube_objects.backoff_left(pod, NOW + dt.timedelta(seconds=12)) == left
        b = reconcile(_obs(job, status, owned, now=NOW + dt.timedelta(seconds=12)))
        if in_place:
            assert not b.delete and b.status["phase"] == "Starting"
            assert any(p["kind"] == "Pod" for p in b.adopt)  # ordered in place
            continue
        assert len(b.delete) == 2 and not b.adopt and b.status["podAttempt"] is None
        assert b.status["restartHistory"][-1]["mode"] == "recreate"
        (event,) = b.events
        assert event.reason == "RecreatingOverBackOff" and "tiny-cpu-a0-n1 in 68 s" in event.message
        assert "recreating the pods" in b.status["message"]
        c = reconcile(_obs(job, {**status, **b.status}, owned, now=NOW + dt.timedelta(seconds=13)))
        new = [p["metadata"]["name"] for p in c.create if p["kind"] == "Pod"]
        assert new == ["tiny-cpu-a1-n0", "tiny-cpu-a1-n1"]  # the next reconcile: new pods
