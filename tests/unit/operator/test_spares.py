"""Hot spares (spec.spareNodes): standby pods kept, refilled, and a lost rank moved to one."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from omni_operator.placement import place_spares
from omni_operator.reconcile import Progress, reconcile
from omni_operator.recovery.failures import Failure
from omni_operator.render import LABEL_ATTEMPT, LABEL_RANK, LABEL_SPARE
from omni_operator.spares import plan_swap, relabel
from omni_trainer.config import ManifestError

from .nodes import node
from .test_reconcile import NOW, _job, _live, _obs, _start

SPARE = {"spareNodes": 1, "restartPolicy": {"backoffSeconds": {"base": 0, "max": 0},
                                             "nodeLostGraceSeconds": 5}}  # fmt: skip


def _running(pods: list[dict]) -> list[dict]:
    """Pods whose container runs (a standby is ready only then)."""
    cs = [{"name": "trainer", "state": {"running": {}}}]
    return [{**p, "status": {**p["status"], "containerStatuses": cs}} if p["kind"] == "Pod" else p
            for p in pods]  # fmt: skip


def _with_spare() -> tuple[object, dict, list[dict]]:
    """A running 2-node job whose standby (created by the next reconcile) runs too."""
    job = _job(**SPARE)
    status, owned = _start(job)
    owned = _running(owned)
    a = reconcile(_obs(job, status, owned))
    (spare,) = [o for o in a.create if o["kind"] == "Pod"]
    assert spare["metadata"]["name"] == "tiny-cpu-s0"
    assert spare["metadata"]["labels"][LABEL_SPARE] == "standby"
    assert LABEL_RANK not in spare["metadata"]["labels"]
    assert "--standby" in spare["spec"]["containers"][0]["command"]
    assert spare["metadata"]["annotations"]["omni.megascale.io/placed-node"] == "n2"
    assert a.status["spares"] == [{"pod": "tiny-cpu-s0", "node": "n2", "ready": False}]
    status = {**status, **a.status}
    return job, status, owned + _running(_live([spare]))


def test_the_standby_is_kept_ready_and_not_a_gang_pod() -> None:
    job, status, owned = _with_spare()
    a = reconcile(_obs(job, status, owned, progress=Progress(step=3)))
    assert not a.create and not a.delete  # one spare, and it is no rank of the gang
    assert a.status["spares"] == [{"pod": "tiny-cpu-s0", "node": "n2", "ready": True}]
    cond = next(c for c in a.status["conditions"] if c["type"] == "SparesReady")
    assert cond["status"] == "True" and cond["message"] == "1 of 1 spares ready"


def test_a_lost_node_moves_its_rank_to_the_spare_and_the_rest_restart_in_place() -> None:
    job, status, owned = _with_spare()
    status = {**status, **reconcile(_obs(job, status, owned, progress=Progress(step=7))).status}
    nodes = [node("n0"), node("n1", ready=False), node("n2"), node("n3")]
    a = reconcile(_obs(job, status, owned, nodes=nodes, progress=Progress(step=7, attempt=0)))
    record = a.status["restartHistory"][-1]
    assert (record["mode"], record["reason"], record["nodes"]) == ("spare", "NodeLost", ["n1"])
    assert a.status["placement"] == ["n0", "n2"] and a.status["podAttempt"] == 0
    assert not a.create and [(d.obj["metadata"]["name"], d.grace_seconds) for d in a.delete] == [
        ("tiny-cpu-a0-n1", 0)]  # fmt: skip
    (patch,) = a.adopt
    assert patch["metadata"]["name"] == "tiny-cpu-s0"
    assert patch["metadata"]["labels"] == {LABEL_SPARE: "assigned", LABEL_RANK: "1"}
    assert "on a hot spare" in a.status["message"]
    assert "SpareAssigned" in [e.reason for e in a.events]
    status = {**status, **a.status}

    # the API applied the patch and the forced deletion; the backoff (0) ended
    spare = next(o for o in owned if o["metadata"]["name"] == "tiny-cpu-s0")
    spare = {**spare, "metadata": {**spare["metadata"], "labels": {
        **spare["metadata"]["labels"], **patch["metadata"]["labels"]}}}  # fmt: skip
    owned = [o for o in owned if o["metadata"]["name"] not in ("tiny-cpu-a0-n1", "tiny-cpu-s0")]
    owned.append(spare)
    b = reconcile(_obs(job, status, owned, nodes=nodes))
    orders = {p["metadata"]["name"]: _order(p) for p in b.adopt if p["kind"] == "Pod"}
    rank1 = {"OMNI_NODE_RANK": "1", "OMNI_PIPELINE_STAGES": "0", "OMNI_REORDER_GROUP": "0"}
    want = {"attempt": 1, "pods": 0, "fresh": True, "spares": {"tiny-cpu-s0": rank1}}
    assert orders == {"tiny-cpu-a0-n0": want, "tiny-cpu-s0": want}  # the survivor, the spare
    assert b.status["phase"] == "Starting" and not b.create and not b.delete
    status = {**status, **b.status}

    # attempt 1 trains on n0 + n2: a new standby goes to the last free node (n3), not n1
    c = reconcile(_obs(job, status, owned, nodes=nodes, now=NOW + dt.timedelta(seconds=4),
                       progress=Progress(step=6, attempt=1, resumed_from=5)))  # fmt: skip
    (new,) = c.create
    assert new["metadata"]["name"] == "tiny-cpu-s1" and new["metadata"]["labels"][
        LABEL_ATTEMPT] == "0"  # fmt: skip
    assert new["metadata"]["annotations"]["omni.megascale.io/placed-node"] == "n3"
    assert c.status["restartHistory"][-1]["lostSeconds"] == 4

    # a later crash: the order keeps the spare's rank (not fresh: no new node)
    status = {**status, **c.status}
    owned = [{**o, "status": {"phase": "Running", "containerStatuses": [{"state": {
        "running": {}}, "lastState": {"terminated": {"exitCode": 1, "finishedAt":
        "2026-12-01T12:00:05Z", "message": "[attempt 1] boom"}}}]}}
        if o["metadata"]["name"] == "tiny-cpu-a0-n0" else o for o in owned]  # fmt: skip
    later = NOW + dt.timedelta(seconds=6)
    d = reconcile(_obs(job, status, owned, nodes=nodes, now=later))
    assert d.status["restartHistory"][-1]["mode"] == "in-place"
    e = reconcile(_obs(job, {**status, **d.status}, owned, nodes=nodes, now=later))
    order = _order(next(p for p in e.adopt if p["metadata"]["name"] == "tiny-cpu-s0"))
    assert order["attempt"] == 2 and "fresh" not in order and "tiny-cpu-s0" in order["spares"]


def _order(pod_patch: dict) -> dict:
    return json.loads(pod_patch["metadata"]["annotations"]["omni.megascale.io/order"])


def test_rank_0_moves_too_and_no_swap_without_a_ready_spare_in_the_domain() -> None:
    job, _, owned = _with_spare()
    pods = [o for o in owned if o["kind"] == "Pod" and LABEL_RANK in o["metadata"]["labels"]]
    standby = [o for o in owned if o["metadata"]["name"] == "tiny-cpu-s0"]
    nodes = {n["metadata"]["name"]: n for n in [node(f"n{i}") for i in range(4)]}
    lost1 = Failure("node_lost", "n1 lost", nodes=("n1",))
    assert plan_swap(lost1, pods, standby, nodes, job=job, now=NOW).ranks == {1: standby[0]}
    # Node rank 0 (the rendezvous host): the relabelled spare is what the rendezvous Service
    # selects once the lost pod is gone, and the spare's torchrun names that Service.
    lost0 = Failure("node_lost", "n0 lost", nodes=("n0",))
    swap = plan_swap(lost0, pods, standby, nodes, job=job, now=NOW)
    assert swap is not None and swap.ranks == {0: standby[0]}
    assert [p["metadata"]["name"] for p in swap.lost] == ["tiny-cpu-a0-n0"]
    (rdzv,) = [o for o in owned if o["metadata"]["name"] == "tiny-cpu-a0-rdzv"]
    labels = {**standby[0]["metadata"]["labels"], **relabel(standby[0], 0)["metadata"]["labels"]}
    assert rdzv["spec"]["selector"].items() <= labels.items()
    assert not rdzv["spec"]["selector"].items() <= standby[0]["metadata"]["labels"].items()
    command = standby[0]["spec"]["containers"][0]["command"]
    assert "--master-addr=tiny-cpu-a0-rdzv.ml.svc" in command
    crash = Failure("pod_failed", "boom", pods=("tiny-cpu-a0-n1",))
    assert plan_swap(crash, pods, standby, nodes, job=job, now=NOW) is None
    other = {**nodes, "n2": node("n2", zone="z2")}  # the spare's node in another domain
    zoned = _job(**SPARE, topology={"networkDomainLabels": ["topology.kubernetes.io/zone"]})
    assert plan_swap(lost1, pods, standby, other, job=zoned, now=NOW) is None
    assert plan_swap(lost1, pods, standby, nodes, job=zoned, now=NOW) is not None
    pending = [{**standby[0], "status": {"phase": "Pending"}}]
    assert plan_swap(lost1, pods, pending, nodes, job=job, now=NOW) is None


def test_spares_leave_with_the_job_and_need_in_place_restarts() -> None:
    job, status, owned = _with_spare()
    done = [{**o, "status": {"phase": "Succeeded"}} if LABEL_RANK in o["metadata"].get(
        "labels", {}) else o for o in owned]  # fmt: skip
    a = reconcile(_obs(job, status, done))
    assert a.status["phase"] == "Succeeded" and a.status["spares"] == []
    assert [d.obj["metadata"]["name"] for d in a.delete] == ["tiny-cpu-s0"]
    with pytest.raises(ManifestError, match=r"spareNodes 1 needs restartPolicy\.mode in-place"):
        _job(spareNodes=1, restartPolicy={"mode": "recreate"})


def test_spares_go_to_free_usable_nodes_of_the_job_s_domains_only() -> None:
    zoned = _job(**SPARE, topology={"networkDomainLabels": ["topology.kubernetes.io/zone"]})
    nodes = [node("n0"), node("n1"), node("n2", zone="z2"), node("n3", ready=False),
             node("n4"), node("n5")]  # fmt: skip
    chosen = place_spares(nodes, zoned.spec, want=2, domains={("z1",)}, taken={"n0", "n1"})
    assert [n["metadata"]["name"] for n in chosen] == ["n4", "n5"]  # not z2, not NotReady
    assert place_spares(nodes, zoned.spec, want=2, domains={("z1",)}, taken={"n0", "n1"},
                        quarantined={"n4"})[0]["metadata"]["name"] == "n5"  # fmt: skip
    spread = place_spares(nodes, zoned.spec, want=2, domains={("z1",), ("z2",)}, taken={"n0"})
    assert sorted(n["metadata"]["name"] for n in spread) == ["n1", "n2"]  # one per domain
