"""Placement on free capacity and the queue: what other pods hold, who waits and for what."""

from __future__ import annotations

import datetime as dt
from typing import Any

from omni_operator import capacity
from omni_operator.admission import admit, queue_ahead
from omni_operator.reconcile import Observed, reconcile
from omni_operator.render import render_all
from omni_operator.sandbox.testbed import job_manifest
from omni_operator.spec import parse_job
from omni_operator.status import OmniTrainingJobStatus

from .nodes import cluster, node

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _pod(node: str | None, *, gpus: int = 0, cpu: str | None = None, phase: str = "Running",
         pinned: str | None = None, ns: str = "other") -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {"containers": [{"resources": {
        "limits": {"nvidia.com/gpu": str(gpus)} if gpus else {},
        "requests": {"cpu": cpu} if cpu else {}}}]}  # fmt: skip
    if node:
        spec["nodeName"] = node
    if pinned:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [pinned]}]}]}}}  # fmt: skip
    return {"metadata": {"name": "x", "namespace": ns, "labels": {}}, "spec": spec,
            "status": {"phase": phase}}  # fmt: skip


def test_requests_follow_kube_scheduler_rules() -> None:
    pod = {"spec": {
        "containers": [{"resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "1Gi"}}},
                       {"resources": {"requests": {"cpu": "1"}}}],
        "initContainers": [{"resources": {"requests": {"cpu": "2", "memory": "512Mi"}}}],
        "overhead": {"cpu": "100m"}}}  # fmt: skip
    assert capacity.pod_requests(pod) == {"cpu": 2.1, "memory": 2**30}


def test_free_counts_bound_and_pinned_pods_of_any_namespace_until_they_end() -> None:
    nodes = cluster({("z1", "a"): 3})
    pods = [_pod("n0", gpus=8), _pod(None, gpus=3, pinned="n1"), _pod("n2", gpus=8,
            phase="Succeeded"), _pod(None, gpus=8)]  # fmt: skip
    free = capacity.free(nodes, pods)
    assert [free[n]["nvidia.com/gpu"] for n in ("n0", "n1", "n2")] == [0, 5, 8]


def test_a_job_that_does_not_fit_beside_others_is_queued_saying_what_it_waits_for() -> None:
    job = parse_job(job_manifest())  # 2 nodes x 2 GPUs, in one spine
    nodes = cluster({("z1", "a"): 2, ("z1", "b"): 2})
    busy = [_pod("n0", gpus=7), _pod("n2", gpus=8)]
    d = admit(nodes, job, cluster_pods=busy)
    assert d.placement is None and d.reason == "InsufficientCapacity"
    head, *detail = d.message.splitlines()
    assert head == "2 nodes with 2 free GPUs in one domain; 1 now"
    assert any("n0 busy (1 of 2 nvidia.com/gpu free)" in line for line in detail), detail
    # the job's own pods (those it replaces) never keep it from its nodes
    own = _pod("n0", gpus=8, ns="ml")
    own["metadata"]["labels"] = {"omni.megascale.io/job": "train"}
    d = admit(nodes, job, cluster_pods=[own, _pod("n2", gpus=8)])
    assert d.placement is not None and d.placement.names == ["n0", "n1"]
    # it never fits: not queued (Placing), whatever runs
    small = [node(f"n{i}", gpus=1) for i in range(4)]
    assert admit(small, job, cluster_pods=[]).reason == "Unschedulable"


def test_cpu_requests_keep_two_jobs_off_one_node() -> None:
    """Default requests take 90 % of a node's CPU: a second job goes to other nodes."""
    job = parse_job(job_manifest(gpusPerNode=0))
    nodes = cluster({("z1", "a"): 4})
    first = admit(nodes, job, cluster_pods=[]).placement
    assert first is not None
    other = parse_job({**job_manifest("other", gpusPerNode=0)})
    pods = [p for p in render_all(job, first, attempt=0) if p["kind"] == "Pod"]
    second = admit(nodes, other, cluster_pods=pods).placement
    assert second is not None and set(second.names).isdisjoint(first.names)


def _queued(name: str, created: str, *, priority: str | None = None, phase: str = "Queued"):
    return {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": created},
            "spec": {"scheduling": {"priorityClassName": priority} if priority else {}},
            "status": {"phase": phase}}  # fmt: skip


def test_first_come_first_served_within_a_priority() -> None:
    classes = [{"metadata": {"name": "high"}, "value": 1000},
               {"metadata": {"name": "low"}, "value": -5, "globalDefault": False}]  # fmt: skip
    jobs = [_queued("a", "2026-01-01T00:00:01Z"), _queued("b", "2026-01-01T00:00:02Z"),
            _queued("c", "2026-01-01T00:00:03Z", priority="high"),
            _queued("d", "2026-01-01T00:00:00Z", phase="Running")]  # fmt: skip
    me = _queued("e", "2026-01-01T00:00:00Z")
    assert queue_ahead(me, jobs, classes) == [("ml", "c")]
    me = _queued("f", "2026-01-01T00:00:05Z")
    assert queue_ahead(me, jobs, classes) == [("ml", "c"), ("ml", "a"), ("ml", "b")]
    assert queue_ahead(jobs[2], jobs, classes) == []  # the high one goes first
    low = _queued("g", "2026-01-01T00:00:00Z", priority="low")
    assert len(queue_ahead(low, jobs, classes)) == 3


def test_reconcile_queues_then_starts_when_capacity_frees() -> None:
    job = parse_job(job_manifest())
    nodes = cluster({("z1", "a"): 2})
    status = OmniTrainingJobStatus()
    obs = Observed(job=job, status=status, owned=[], nodes=nodes, now=NOW,
                   cluster_pods=[_pod("n1", gpus=7)])  # fmt: skip
    a = reconcile(obs)
    assert a.status["phase"] == "Queued" and not a.create
    assert a.status["message"] == "queued: 2 nodes with 2 free GPUs in one domain; 1 now"
    cond = {c["type"]: c for c in a.status["conditions"]}["Queued"]
    assert cond["status"] == "True" and cond["reason"] == "InsufficientCapacity"
    status = OmniTrainingJobStatus.model_validate({**status.model_dump(by_alias=True), **a.status})
    behind = reconcile(Observed(job=job, status=status, owned=[], nodes=nodes, now=NOW,
                                cluster_pods=[], queue_ahead=[("ml", "first")]))  # fmt: skip
    assert not behind.create and "behind 1 job queued earlier" in behind.status["message"]
    b = reconcile(Observed(job=job, status=status, owned=[], nodes=nodes, now=NOW,
                           cluster_pods=[]))  # fmt: skip
    assert b.status["phase"] == "Starting" and len([o for o in b.create if o["kind"] == "Pod"]) == 2
    cond = {c["type"]: c for c in b.status["conditions"]}["Queued"]
    assert cond["status"] == "False" and cond["reason"] == "Admitted"
    # the status write after creating the pods was lost (409): the re-run adopts them
    pods = [{**o, "metadata": {**o["metadata"], "uid": "x"}} for o in b.create]
    again = reconcile(Observed(job=job, status=status, owned=pods, nodes=nodes, now=NOW,
                               cluster_pods=[p for p in pods if p["kind"] == "Pod"]))  # fmt: skip
    assert again.status["phase"] == "Starting" and not again.create and not again.delete
