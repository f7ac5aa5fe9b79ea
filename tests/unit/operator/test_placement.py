"""Placement: usable nodes only, reorder groups inside one domain, stages on whole nodes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml

from omni_operator.placement import PlacementError, place
from omni_operator.spec import OmniTrainingJobSpec, parse_job

from ...conftest import EXAMPLES
from .nodes import SPINE, ZONE, cluster, node


def _spec(**spec: Any) -> OmniTrainingJobSpec:
    doc = yaml.safe_load((EXAMPLES / "paper-workload-a.yaml").read_text())  # tp 4, pp 2
    doc["spec"].update(spec)
    return parse_job(doc).spec


def _topo(group: int, labels: tuple[str, ...] = (ZONE, SPINE)) -> dict[str, Any]:
    return {"networkDomainLabels": list(labels), "reorderGroupSize": group}


def test_groups_stay_in_one_domain_and_ranks_are_consecutive() -> None:
    nodes = cluster({("z1", "a"): 4, ("z1", "b"): 4, ("z2", "c"): 4})
    spec = _spec(nodes=8, topology=_topo(4))
    p = place(nodes, spec)
    assert [n.rank for n in p.nodes] == list(range(8))
    for gid in (0, 1):
        domains = {n.domain for n in p.nodes if n.reorder_group == gid}
        assert len(domains) == 1
    # best fit keeps the job in one zone: z1 holds both groups
    assert {n.domain for n in p.nodes} == {("z1", "a"), ("z1", "b")}
    assert [n.stages for n in p.nodes] == [(0,)] * 4 + [(1,)] * 4


def test_skips_unusable_nodes_with_reasons() -> None:
    nodes = [
        node("n0"),
        node("n1", ready=False),
        node("n2", taints=[{"key": "maint", "effect": "NoSchedule"}]),
        node("n3", unschedulable=True),
        node("n4", gpus=4),
        node("n5"),
        node("n6", ready=None),
        node("n7", zone=None),
        node("n8"),
        node("n9"),
        node("n10", taints=[{"key": "soft", "effect": "PreferNoSchedule"}]),
    ]
    p = place(nodes, _spec(nodes=4, topology=_topo(4)), quarantined=["n8"])
    assert p.names == ["n0", "n5", "n9", "n10"]
    assert p.skipped == {
        "n1": "NotReady",
        "n2": "taint maint:NoSchedule not tolerated",
        "n3": "cordoned",
        "n4": "4 of 8 nvidia.com/gpu allocatable",
        "n6": "no Ready condition",
        "n7": f"no label {ZONE}",
        "n8": "quarantined",
    }


def test_explains_why_a_job_does_not_fit() -> None:
    nodes = cluster({("z1", "a"): 4, ("z1", "b"): 4})
    nodes[1]["status"]["conditions"][0]["status"] = "False"  # n1
    with pytest.raises(PlacementError) as info:
        place(nodes, _spec(nodes=8, topology=_topo(4)), quarantined=["n3"])
    message = str(info.value)
    assert "2 reorder groups of 4 nodes, each inside one network domain" in message
    assert "1 fit" in message
    assert "zone=z1,spine=a: 2 usable, fits 0 groups (n1 NotReady; n3 quarantined)" in message
    assert "zone=z1,spine=b: 4 usable, fits 1 group" in message


def test_enough_nodes_but_split_across_domains_is_refused() -> None:
    # 5 + 7 usable nodes for 12, pp 2: groups of 6 (one per stage) need a 6-node domain twice.
    nodes = cluster({("z1", "a"): 6, ("z1", "b"): 7})
    spec = _spec(nodes=12, topology=_topo(6), trainer=_trainer(gbs=12))
    with pytest.raises(PlacementError, match=r"2 reorder groups of 6 nodes.*; 1 fit"):
        place(nodes, spec, quarantined=["n0"])
    one = spec.model_copy(
        update={"topology": spec.topology.model_copy(update={"reorder_group_size": 1})}
    )
    p = place(nodes, one, quarantined=["n0"])
    assert len({n.domain for n in p.nodes}) == 2 and "n0" not in p.names


def _trainer(*, gbs: int) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / "paper-workload-a.yaml").read_text())["spec"]["trainer"]
    doc["data"]["globalBatchSize"] = gbs
    return doc


def test_pipeline_slots_come_from_neighbouring_domains() -> None:
    # 4 spines in 2 zones, one group each: pipeline k (stage 0 + stage 1) should use one zone.
    nodes = cluster({("z1", "a"): 2, ("z1", "b"): 2, ("z2", "c"): 2, ("z2", "d"): 2})
    p = place(nodes, _spec(nodes=8, topology=_topo(2)))
    by_rank = [n.domain for n in p.nodes]
    stage0, stage1 = by_rank[:4], by_rank[4:]
    for k in range(2):  # slot k of stage 0 talks to slot k of stage 1
        assert stage0[2 * k][0] == stage1[2 * k][0], (stage0, stage1)
    assert [n.reorder_group for n in p.nodes] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_deterministic_regardless_of_input_order() -> None:
    nodes = cluster({("z1", "a"): 5, ("z1", "b"): 7, ("z2", "c"): 9})
    spec = _spec(nodes=8, topology=_topo(2))
    first = place(nodes, spec)
    shuffled = list(nodes)
    random.Random(0).shuffle(shuffled)
    assert place(shuffled, spec) == first


def test_natural_name_order() -> None:
    nodes = [node(f"gpu{i}") for i in (10, 2, 1, 11)]
    assert place(nodes, _spec(nodes=2)).names == ["gpu1", "gpu2"]


def test_without_labels_any_usable_nodes_do() -> None:
    nodes = [node(f"n{i}", zone=None, spine=None) for i in range(3)]
    p = place(nodes, _spec(nodes=2))
    assert p.names == ["n0", "n1"] and p.nodes[0].domain == ()
    with pytest.raises(PlacementError, match=r"cannot place 4 nodes .*: 3 usable"):
        place(nodes, _spec(nodes=4))


def test_tolerations_selectors_and_rdma() -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    nodes = [
        node("n0", taints=[taint], rdma=1, labels={"pool": "h100"}),
        node("n1", taints=[taint], rdma=0, labels={"pool": "h100"}),
        node("n2", taints=[taint], rdma=2, labels={"pool": "a100"}),
        node("n3", taints=[taint], rdma=1, labels={"pool": "h100"}),
    ]
    spec = _spec(
        nodes=2,
        resources={"rdma": {"resourceName": "rdma/ib", "count": 1}},
        scheduling={
            "nodeSelector": {"pool": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
    )
    p = place(nodes, spec)
    assert p.names == ["n0", "n3"]
    assert p.skipped == {
        "n1": "0 of 1 rdma/ib allocatable",
        "n2": "nodeSelector pool=h100 does not match",
    }
    untolerated = spec.model_copy(
        update={"scheduling": spec.scheduling.model_copy(update={"tolerations": []})}
    )
    with pytest.raises(PlacementError, match=r"taint nvidia\.com/gpu=present:NoSchedule"):
        place(nodes, untolerated)


def test_more_stages_than_nodes() -> None:
    # pp 8 on 2 nodes of 8 GPUs with tp 2: 4 stages per node.
    spec = _spec(nodes=2, trainer=_trainer(gbs=8) | {"parallelism": {"tensor": 2, "pipeline": 8}})
    p = place([node("a"), node("b")], spec)
    assert [n.stages for n in p.nodes] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_explain_mentions_every_group_and_skip() -> None:
    nodes = cluster({("z1", "a"): 4, ("z1", "b"): 4})
    text = place(nodes, _spec(nodes=4, topology=_topo(2)), quarantined=["n0"]).explain()
    # spine a has 3 usable nodes, b has 4: b is the smallest domain that holds both groups
    assert "reorder group 0 (node ranks 0-1, pipeline stage 0) in zone=z1,spine=b: n4 n5" in text
    assert "reorder group 1 (node ranks 2-3, pipeline stage 1)" in text
    assert text.splitlines()[-1] == "skipped: n0 quarantined"
