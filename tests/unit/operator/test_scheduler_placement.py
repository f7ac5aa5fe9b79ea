"""scheduling.placement scheduler: constraints instead of pins, ranks from the bound nodes."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
import yaml

from omni_operator.placement import place, rank_bound
from omni_operator.reconcile import reconcile
from omni_operator.render import (
    ANNOTATION_NODE,
    ANNOTATION_ORDER,
    LABEL_PLACEMENT,
    LABEL_RANK,
    render_all,
)
from omni_operator.sandbox.scheduling import first_fit
from omni_operator.spec import parse_job
from omni_trainer.config import ManifestError

from ...conftest import EXAMPLES
from .nodes import SPINE, ZONE, cluster, node
from .test_placement import _spec, _topo
from .test_reconcile import NOW, _crashed, _job, _obs

SCHED = {"placement": "scheduler"}
TOPO = {"networkDomainLabels": [ZONE, SPINE]}
NODES = cluster({("z1", "a"): 2, ("z1", "b"): 2})
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
GROUP_LABEL = "omni.megascale.io/reorder-group"


def _pods(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] == "Pod"]


def _bind(pods: list[dict], nodes: list[str]) -> list[dict]:
    """The pods as the API returns them once the scheduler bound them to ``nodes``."""
    return [{**p, "metadata": {**p["metadata"], "uid": "x"},
             "spec": {**p["spec"], "nodeName": n}, "status": {"phase": "Running"}}
            for p, n in zip(pods, nodes, strict=True)]  # fmt: skip


def test_the_default_is_the_operators_pinning() -> None:
    job = _job(topology=TOPO)
    assert job.spec.scheduling.placement == "operator"
    (pod, _) = _pods(render_all(job, place(NODES, job.spec)))
    assert "nodeAffinity" in pod["spec"]["affinity"] and pod["metadata"]["annotations"]


def test_placement_scheduler_needs_in_place_restarts() -> None:
    with pytest.raises(ManifestError, match=r"spec\.scheduling\.placement: .*mode in-place"):
        _job(scheduling=SCHED, restartPolicy={"mode": "recreate"})
    with pytest.raises(ManifestError, match=r"spec\.scheduling\.placement"):
        _job(scheduling={"placement": "kube"})


def test_pods_carry_constraints_and_no_node() -> None:
    job = _job(scheduling=SCHED, topology=TOPO)
    objs = render_all(job, place(NODES, job.spec), attempt=3, quarantined=["n9", "n8"])
    pods = _pods(objs)
    assert [p["metadata"]["name"] for p in pods] == ["tiny-cpu-a3-p0", "tiny-cpu-a3-p1"]
    for pod in pods:
        meta, spec = pod["metadata"], pod["spec"]
        assert "nodeName" not in spec and ANNOTATION_NODE not in meta.get("annotations", {})
        assert LABEL_RANK not in meta["labels"] and meta["labels"][LABEL_PLACEMENT] == "scheduler"
        gang = {"omni.megascale.io/job": "tiny-cpu", "omni.megascale.io/attempt": "3"}
        (anti,) = spec["affinity"]["podAntiAffinity"][REQUIRED]
        assert anti == {"labelSelector": {"matchLabels": gang},
                        "topologyKey": "kubernetes.io/hostname"}  # fmt: skip
        near = spec["affinity"]["podAffinity"][REQUIRED]
        assert [t["topologyKey"] for t in near] == [ZONE, SPINE]  # one domain: every level
        (term,) = spec["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": ["n8", "n9"]}
        ]
        assert "--standby" in spec["containers"][0]["command"]  # waits for its rank


def test_several_reorder_groups_each_require_one_domain() -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["trainer"]["data"]["microBatchSize"] = 2
    doc["spec"].update(nodes=4, gpusPerNode=0, scheduling=SCHED,
                       topology={**TOPO, "reorderGroupSize": 2})  # fmt: skip
    job = parse_job(doc)
    pods = _pods(render_all(job, place(NODES, job.spec)))
    assert [p["metadata"]["labels"][GROUP_LABEL] for p in pods] == ["0", "0", "1", "1"]
    near = pods[3]["spec"]["affinity"]["podAffinity"]
    assert near[REQUIRED][0]["labelSelector"]["matchLabels"][GROUP_LABEL] == "1"
    (pref,) = near["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["podAffinityTerm"]["topologyKey"] == SPINE


def test_ranks_follow_domains_then_names() -> None:
    nodes = cluster({("z1", "a"): 2, ("z1", "b"): 2, ("z2", "c"): 2, ("z2", "d"): 2})
    spec = _spec(nodes=8, topology=_topo(2))
    bound = list(reversed(nodes))
    p = rank_bound(bound, spec)
    assert sorted(p.names) == sorted(n["metadata"]["name"] for n in nodes)
    assert [n.reorder_group for n in p.nodes] == [0, 0, 1, 1, 2, 2, 3, 3]
    for g in range(4):  # each reorder group inside one domain
        assert len({n.domain for n in p.nodes if n.reorder_group == g}) == 1
    by_rank = [n.domain for n in p.nodes]
    for k in range(2):  # pipeline slot k of both stages in one zone, as place() keeps it
        assert by_rank[2 * k][0] == by_rank[4 + 2 * k][0]
    assert rank_bound(nodes, spec) == p == place(nodes, spec)  # same layout as the operator's


def test_a_bound_attempt_gets_its_ranks_through_labels_and_orders() -> None:
    job = _job(scheduling=SCHED, topology=TOPO)
    a = reconcile(_obs(job, nodes=NODES))
    assert a.status["phase"] == "Starting" and a.status["placement"] == []
    placed = next(c for c in a.status["conditions"] if c["type"] == "Placed")
    assert placed["status"] == "False" and placed["reason"] == "Scheduling"
    status = a.status
    created = [{**o, "metadata": {**o["metadata"], "uid": "x"}} for o in a.create]
    pending = [{**p, "status": {"phase": "Pending"}} for p in _pods(created)]
    others = [o for o in created if o["kind"] != "Pod"]
    b = reconcile(_obs(job, status, others + pending, nodes=NODES))
    assert not [x for x in b.adopt if x["kind"] == "Pod"]  # nothing bound yet: no ranks
    assert "phase" not in b.status and not b.delete  # unranked pods are no missing ranks

    bound = _bind(_pods(created), ["n3", "n2"])  # spine b, in reverse name order
    c = reconcile(_obs(job, status, others + bound, nodes=NODES))
    assert c.status["placement"] == ["n2", "n3"]
    patches = {x["metadata"]["name"]: x for x in c.adopt if x["kind"] == "Pod"}
    assert patches["tiny-cpu-a0-p1"]["metadata"]["labels"] == {LABEL_RANK: "0"}
    assert patches["tiny-cpu-a0-p0"]["metadata"]["labels"] == {LABEL_RANK: "1"}
    assert patches["tiny-cpu-a0-p1"]["metadata"]["annotations"][ANNOTATION_NODE] == "n2"
    order = json.loads(patches["tiny-cpu-a0-p0"]["metadata"]["annotations"][ANNOTATION_ORDER])
    assert order["attempt"] == 0 and order["pods"] == 0
    assert order["spares"]["tiny-cpu-a0-p0"]["OMNI_NODE_RANK"] == "1"
    assert order["spares"]["tiny-cpu-a0-p1"]["OMNI_NODE_RANK"] == "0"
    assert any(e.reason == "RanksAssigned" for e in c.events)

    # ranked pods watched as any: an in-place restart's order keeps each pod's rank
    ranked = [_relabel(p, patches[p["metadata"]["name"]]) for p in bound]
    status = {**status, **c.status}
    d = reconcile(_obs(job, status, others + ranked, nodes=NODES))
    assert d.status.get("phase", status["phase"]) in ("Starting", "Running")
    assert not [x for x in d.adopt if x["kind"] == "Pod"]
    crashed = [_crashed(ranked[0], attempt=0), ranked[1]]
    e = reconcile(_obs(job, {**status, **d.status}, others + crashed, nodes=NODES))
    status = {**status, **d.status, **e.status}
    assert status["phase"] == "Restarting" and status["placement"] == ["n2", "n3"]
    later = NOW + dt.timedelta(seconds=11)  # the backoff (10 s) ended
    f = reconcile(_obs(job, status, others + crashed, nodes=NODES, now=later))
    orders = [json.loads(x["metadata"]["annotations"][ANNOTATION_ORDER]) for x in f.adopt
              if x["kind"] == "Pod"]  # fmt: skip
    assert orders and all(o["attempt"] == 1 for o in orders)
    assert orders[0]["spares"]["tiny-cpu-a0-p1"]["OMNI_NODE_RANK"] == "0"


def _relabel(pod: dict, patch: dict) -> dict:
    """``pod`` with a merge patch of its labels and annotations applied."""
    meta, new = pod["metadata"], patch["metadata"]
    labels = {**meta["labels"], **new["labels"]}
    annotations = {**meta.get("annotations", {}), **new["annotations"]}
    return {**pod, "metadata": {**meta, "labels": labels, "annotations": annotations}}


def _gang_pod(name: str, **labels: str) -> dict[str, Any]:
    job = _job(scheduling=SCHED, topology=TOPO)
    (pod, _) = _pods(render_all(job, place(NODES, job.spec), quarantined=["n0"]))
    meta = {**pod["metadata"], "name": name, "labels": {**pod["metadata"]["labels"], **labels}}
    return {**pod, "metadata": meta}


def test_the_emulated_scheduler_keeps_the_constraints() -> None:
    nodes = [*cluster({("z1", "a"): 2, ("z1", "b"): 2}), node("n4", spine="c", gpus=0)]
    first = _gang_pod("p0")
    assert first_fit(first, nodes, [], NOW) == "n1"  # n0 quarantined; the first pod anywhere
    placed = [{**first, "spec": {**first["spec"], "nodeName": "n1"}}]
    assert first_fit(_gang_pod("p1"), nodes, placed, NOW) is None  # n0 excluded, spine a full
    other = {**placed[0], "spec": {**placed[0]["spec"], "nodeName": "n2"}}
    assert first_fit(_gang_pod("p1"), nodes, [other], NOW) == "n3"  # beside its peer, not on it
    busy = [{**other, "metadata": {**other["metadata"], "labels": {"x": "y"}}}]
    assert first_fit(_gang_pod("p1"), nodes, busy, NOW) == "n1"  # n2's pod is no peer
    lost = [node(n["metadata"]["name"], ready=False) for n in nodes[:4]]
    assert first_fit(_gang_pod("p1"), lost, [], NOW) is None
