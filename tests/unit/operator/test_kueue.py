"""Kueue as the admission path: gated pods are Queued (the start deadline waits for admission),
a preemption is a graceful stop that costs no restart."""

from __future__ import annotations

import datetime as dt
from typing import Any

from omni_operator.kueue import GATE, evicted, waiting
from omni_operator.reconcile import reconcile

from .test_reconcile import NOW, _cond, _job, _live, _obs

GATED = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
         "message": "Scheduling is blocked due to non-empty scheduling gates"}  # fmt: skip


def _gate(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods as Kueue's webhook and kube-scheduler leave them before admission."""
    return [{**p, "spec": {**{k: v for k, v in p["spec"].items() if k != "nodeName"},
                           "schedulingGates": [{"name": GATE}]},
             "status": {"phase": "Pending", "conditions": [GATED]}}
            if p["kind"] == "Pod" else p for p in pods]  # fmt: skip


def test_gated_pods_are_queued_and_the_start_deadline_counts_from_admission() -> None:
    job = _job(scheduling={"kueueQueue": "team-a"},
               restartPolicy={"startTimeoutSeconds": 60})  # fmt: skip
    first = reconcile(_obs(job))
    pods = [p for p in first.create if p["kind"] == "Pod"]
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" for p in pods)
    owned = _gate(_live(first.create))
    status = first.status
    later = NOW + dt.timedelta(hours=2)  # far past the start deadline
    held = reconcile(_obs(job, status, owned, now=later))
    status = {**status, **held.status}
    assert status["phase"] == "Queued" and not held.delete
    assert status["message"] == ("queued: 2 of 2 pods gated by Kueue (LocalQueue team-a): "
                                 "SchedulingGated: Scheduling is blocked due to non-empty "
                                 "scheduling gates")  # fmt: skip
    assert _cond(status, "Queued")["reason"] == "SchedulingGated"
    admitted = _live(first.create, phase="Pending")  # gates removed, bound, not running yet
    a = reconcile(_obs(job, status, admitted, now=later + dt.timedelta(seconds=30)))
    status = {**status, **a.status}
    assert status["phase"] == "Starting" and not a.delete, status["message"]
    assert _cond(status, "Queued")["reason"] == "Admitted"
    on_time = reconcile(_obs(job, status, admitted, now=later + dt.timedelta(seconds=85)))
    assert on_time.status.get("phase") is None  # 55 s after admission: still starting
    late = reconcile(_obs(job, status, admitted, now=later + dt.timedelta(seconds=95)))
    assert late.status.get("phase") == "Restarting"  # 65 s after admission: a stuck start


def test_a_preemption_stops_gracefully_and_costs_no_restart() -> None:
    job = _job(scheduling={"kueueQueue": "team-a"})
    first = reconcile(_obs(job))
    status, owned = first.status, _live(first.create)
    running = reconcile(_obs(job, status, owned))
    status = {**status, **running.status}
    assert status["phase"] == "Running"
    stop = {"type": "DisruptionTarget", "status": "True", "reason": "Preempted",
            "message": "Preempted to accommodate a higher priority Workload"}  # fmt: skip
    hit = [{**o, "metadata": {**o["metadata"], "deletionTimestamp": "2026-12-01T12:00:00Z"},
            "status": {**o["status"], "conditions": [stop]}} if o["kind"] == "Pod" else o
           for o in owned]  # fmt: skip
    assert evicted([o for o in hit if o["kind"] == "Pod"]) is not None
    assert waiting([o for o in hit if o["kind"] == "Pod"]) is None
    a = reconcile(_obs(job, status, hit))
    after = {**status, **a.status}
    assert after["phase"] == "Queued" and after["attempt"] == 1
    assert after["restartBudgetLeft"] == status["restartBudgetLeft"] == 10
    assert after["restarts"] == 0 and not after.get("restartHistory")
    assert "Preempted" in after["message"] and any(e.reason == "Preempted" for e in a.events)
    # its old pods still stop (emergency checkpoint): the next attempt waits for them
    b = reconcile(_obs(job, after, hit))
    assert not b.create and _cond({**after, **b.status}, "PodsRunning")["reason"] == "Stopping"
    c = reconcile(_obs(job, after, [o for o in hit if o["kind"] != "Pod"]))
    assert [p["metadata"]["name"] for p in c.create if p["kind"] == "Pod"] == [
        "tiny-cpu-a1-n0", "tiny-cpu-a1-n1"]  # fmt: skip
