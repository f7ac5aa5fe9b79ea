"""scheduling.placement scheduler with the real operator: the emulated scheduler binds the pods,
node ranks follow the bound nodes, and a lost node restarts the job on others."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from omni_operator.reconcile import Progress
from omni_operator.render import ANNOTATION_NODE, ANNOTATION_ORDER, LABEL_RANK
from omni_operator.sandbox.testbed import Cluster, job_manifest, running_cluster

pytestmark = pytest.mark.asyncio
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


@pytest_asyncio.fixture
async def three() -> AsyncIterator[Cluster]:
    """Three nodes in one spine: room for the job twice over, less one node."""
    logging.getLogger("kopf").setLevel(logging.WARNING)
    async with running_cluster(["a", "a", "a"]) as c:
        yield c


def _ranks(c: Cluster, attempt: int) -> dict[str, str | None]:
    return {p["metadata"]["name"]: p["metadata"]["labels"].get(LABEL_RANK)
            for p in c.pods("train", attempt)}  # fmt: skip


def _order(pod: dict[str, Any]) -> dict[str, Any]:
    return json.loads(pod["metadata"]["annotations"][ANNOTATION_ORDER])


async def test_the_scheduler_binds_ranks_follow_and_a_lost_node_moves_the_job(
    three: Cluster,
) -> None:
    c = three
    await c.apply(job_manifest(scheduling={"placement": "scheduler"}))
    await c.wait("2 pods", lambda: len(c.pods("train", 0)) == 2)
    pods = c.pods("train", 0)
    assert [p["metadata"]["name"] for p in pods] == ["train-a0-p0", "train-a0-p1"]
    for pod in pods:  # no node named: constraints only
        affinity = pod["spec"]["affinity"]
        assert "nodeName" not in pod["spec"] and "nodeAffinity" not in affinity
        assert ANNOTATION_NODE not in pod["metadata"]["annotations"]
        assert affinity["podAntiAffinity"][REQUIRED] and affinity["podAffinity"][REQUIRED]
    await c.wait("Starting", lambda: c.status("train").get("phase") == "Starting")
    assert not c.status("train").get("placement")

    for pod in reversed(pods):  # p1 is bound first: the first fit, n0
        await c.run_pod(pod)
    await c.wait("ranks", lambda: _ranks(c, 0) == {"train-a0-p1": "0", "train-a0-p0": "1"})
    assert c.status("train")["placement"] == ["n0", "n1"]
    p0 = next(p for p in c.pods("train", 0) if p["metadata"]["name"] == "train-a0-p0")
    assert p0["spec"]["nodeName"] == "n1" and p0["metadata"]["annotations"][ANNOTATION_NODE] == "n1"
    rank = _order(p0)["spares"]["train-a0-p0"]  # what its standby supervisor starts with
    assert rank["OMNI_NODE_RANK"] == "1" and rank["OMNI_REORDER_GROUP"] == "0"
    await c.wait("Running", lambda: c.status("train").get("phase") == "Running")
    placed = next(x for x in c.status("train")["conditions"] if x["type"] == "Placed")
    assert placed["reason"] == "BoundByScheduler"

    c.progress["train"] = Progress(step=120, checkpoint_step=100)
    await c.wait("checkpoint", lambda: c.status("train").get("lastCheckpoint"))
    await c.node_not_ready("n0")  # rank 0's node
    c.clock.advance(31)  # past nodeLostGraceSeconds (30)
    await c.wait("attempt 1 pods", lambda: len(c.pods("train", 1)) == 2)
    await c.wait("attempt 0 gone", lambda: not c.pods("train", 0))
    pods = c.pods("train", 1)
    assert all(LABEL_RANK not in p["metadata"]["labels"] for p in pods)
    await c.run_pods("train", 1)  # n0 is NotReady: the scheduler skips it
    await c.wait("ranks of attempt 1", lambda: c.status("train").get("placement") == ["n1", "n2"])
    await c.wait("labels", lambda: _ranks(c, 1) == {"train-a1-p0": "0", "train-a1-p1": "1"})
    await c.wait("Running again", lambda: c.status("train").get("phase") == "Running")
    st = c.status("train")
    (record,) = st["restartHistory"]
    assert record["reason"] == "NodeLost" and record["nodes"] == ["n0"]
    assert st["attempt"] == 1 and record["fromStep"] == 100
    orders = [_order(p) for p in c.pods("train", 1)]
    assert all(o["attempt"] == 1 and o["pods"] == 1 for o in orders)
