"""Jobs share the cluster with each other and with other workloads: a job placed on free
capacity only, queued until capacity frees, first come first served."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator.sandbox.testbed import NS, Cluster, job_manifest

pytestmark = pytest.mark.asyncio


def _foreign_pod(node: str, gpus: int) -> dict[str, Any]:
    """Another team's pod, in another namespace, bound to ``node``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "inference", "namespace": "default"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "x",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        },
    }  # fmt: skip


async def test_a_job_waits_queued_while_others_hold_its_nodes_then_starts(cluster: Cluster) -> None:
    c = cluster
    await c.call("POST", "/api/v1/namespaces/default/pods", _foreign_pod("n2", 7))
    await c.apply(job_manifest("first"))
    await c.wait("first placed", lambda: len(c.pods("first")) == 2)
    await c.apply(job_manifest("second"))
    await c.apply(job_manifest("third"))
    await c.wait("second queued", lambda: c.status("second").get("phase") == "Queued")
    await c.wait("third queued", lambda: c.status("third").get("phase") == "Queued")
    assert not c.pods("second") and not c.pods("third")
    status = c.status("second")
    assert status["message"] == "queued: 2 nodes with 2 free GPUs in one domain; 1 now"
    cond = {x["type"]: x for x in status["conditions"]}["Queued"]
    assert cond["reason"] == "InsufficientCapacity"
    assert "n2 busy (1 of 2 nvidia.com/gpu free)" in cond["message"]
    assert "n0 busy" in cond["message"]  # the first job's pods hold n0 and n1 (CPU and GPUs)

    def third_queued() -> dict[str, Any]:
        return {x["type"]: x for x in c.status("third")["conditions"]}["Queued"]

    # third's first reconcile may run before second's status says Queued (the two race for the
    # placing lock): it then waits for capacity, and behind second from its next reconcile on
    await c.wait("third behind second", lambda: third_queued()["reason"] == "BehindInQueue",
                 timeout=30)  # fmt: skip
    assert f"{NS}/second" in third_queued()["message"]

    await c.run_pods("first")
    for pod in c.pods("first"):
        await c.exit_pod(pod["metadata"]["name"], 0)
    await c.wait("first done", lambda: c.status("first").get("phase") == "Succeeded")
    await c.wait("second placed", lambda: len(c.pods("second")) == 2, timeout=20)
    await c.wait("second starting", lambda: c.status("second").get("phase") == "Starting")
    assert sorted(c.status("second")["placement"]) == ["n0", "n1"]
    cond = {x["type"]: x for x in c.status("second")["conditions"]}["Queued"]
    assert cond["status"] == "False" and cond["reason"] == "Admitted"
    assert c.status("third").get("phase") == "Queued" and not c.pods("third")
