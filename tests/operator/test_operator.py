"""The operator end to end against the API emulator: create, recover, fail, suspend, delete."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock
import pytest

from omni_operator.metrics import OperatorMetrics
from omni_operator.reconcile import Progress
from omni_operator.render import ANNOTATION_NODE, LABEL_ATTEMPT, LABEL_JOB
from omni_operator.sandbox.testbed import NS, Cluster, job_manifest

from ..jobs import INVALID, invalid_job

pytestmark = pytest.mark.asyncio


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def _node_of(pod: dict[str, Any]) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    (value,) = terms[0]["matchFields"][0]["values"]
    assert pod["metadata"]["annotations"][ANNOTATION_NODE] == value
    return value


def _reasons(c: Cluster, job: str) -> list[str]:
    return [e["reason"] for e in c.events(job)]


async def _running(c: Cluster, job: str = "train", attempt: int = 0) -> list[dict[str, Any]]:
    await c.wait(f"2 pods of attempt {attempt}", lambda: len(c.pods(job, attempt)) == 2)
    await c.wait("phase Starting", lambda: c.status(job).get("phase") == "Starting")
    await c.run_pods(job)
    await c.wait("phase Running", lambda: c.status(job).get("phase") == "Running")
    await c.wait(
        "PodsRunning",
        lambda: any(
            x["type"] == "PodsRunning" and x["status"] == "True"
            for x in c.status(job).get("conditions", [])
        ),
    )
    return c.pods(job, attempt)


async def test_apply_creates_ranked_pods_in_one_spine(cluster: Cluster) -> None:
    created = await cluster.apply(job_manifest())
    pods = await _running(cluster)
    names = [p["metadata"]["name"] for p in pods]
    assert names == ["train-a0-n0", "train-a0-n1"]
    nodes = [_node_of(p) for p in pods]
    assert nodes == ["n0", "n1"]  # one reorder group: both in spine a
    for rank, pod in enumerate(pods):
        env = _env(pod)
        assert env["OMNI_NODE_RANK"] == str(rank)
        assert env["OMNI_NNODES"] == "2" and env["OMNI_NPROC_PER_NODE"] == "2"
        assert env["OMNI_RESTART_ATTEMPT"] == "0" and env["OMNI_RESUME"] == "auto"
        assert env["MASTER_ADDR"] == f"train-a0-rdzv.{NS}.svc"
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["uid"] == created["metadata"]["uid"] and owner["controller"] is True
    assert cluster.emu.stored("v1/configmaps", NS, "train-config") is not None
    assert cluster.emu.stored("v1/services", NS, "train")["spec"]["clusterIP"] == "None"
    rdzv = cluster.emu.stored("v1/services", NS, "train-a0-rdzv")
    assert rdzv["spec"]["selector"]["omni.megascale.io/node-rank"] == "0"
    status = cluster.status("train")
    assert status["placement"] == ["n0", "n1"] and status["attempt"] == 0
    assert status["restartBudgetLeft"] == 10
    conditions = {x["type"]: x for x in status["conditions"]}
    assert conditions["Valid"]["status"] == "True" and conditions["Placed"]["status"] == "True"
    assert "PodsCreated" in _reasons(cluster, "train")


async def test_node_lost_restarts_on_other_nodes_from_the_checkpoint(cluster: Cluster) -> None:
    await cluster.apply(job_manifest())
    await _running(cluster)
    cluster.progress["train"] = Progress(step=120, checkpoint_step=100, tokens_per_second=5e3)
    await cluster.wait("checkpoint recorded", lambda: cluster.status("train").get("lastCheckpoint"))

    await cluster.node_not_ready("n1")  # unreachable, within the grace: nothing happens yet
    await asyncio.sleep(0.6)
    assert cluster.status("train")["attempt"] == 0
    cluster.clock.advance(31)  # past nodeLostGraceSeconds (30)

    pods = await _running(cluster, attempt=1)
    assert not cluster.pods("train", 0)  # old attempt deleted (n1's pod forcibly)
    assert [_node_of(p) for p in pods] == ["n2", "n3"]  # spine a has one usable node left
    assert {_env(p)["OMNI_RESTART_ATTEMPT"] for p in pods} == {"1"}
    st = cluster.status("train")
    assert st["restarts"] == 1 and st["attempt"] == 1 and st["phase"] == "Running"
    (rec,) = st["restartHistory"]
    assert rec["reason"] == "NodeLost" and rec["nodes"] == ["n1"] and rec["fromStep"] == 100
    assert "node n1 is unreachable" in rec["message"]
    assert st["step"] == 120 and st["tokensPerSecond"] == 5e3
    await cluster.wait("NodeLost event", lambda: "NodeLost" in _reasons(cluster, "train"))
    (event,) = [e for e in cluster.events("train") if e["reason"] == "NodeLost"]
    assert event["type"] == "Warning"
    assert "from the newest checkpoint (step 100 or newer)" in event["message"]


async def test_two_lost_nodes_return_are_unquarantined_and_the_job_succeeds(
    cluster: Cluster,
) -> None:
    """Two node losses in a row, each node quarantined at once (quarantineAfterFailures 1);
    each returns, and once its quarantine expired and it has been Ready quarantineReadySeconds,
    it is lifted while the job runs (an Event, status.quarantine empty); the job succeeds."""
    policy = {"quarantineAfterFailures": 1, "quarantineSeconds": 60, "quarantineReadySeconds": 10}
    await cluster.apply(job_manifest(restartPolicy=policy))
    await _running(cluster)

    def quarantined() -> list[str]:
        return [e["node"] for e in cluster.status("train").get("quarantine") or []]

    for attempt, lost, placed in ((1, "n1", ["n2", "n3"]), (2, "n3", ["n0", "n1"])):
        await cluster.node_not_ready(lost)
        cluster.clock.advance(31)  # past nodeLostGraceSeconds (30)
        pods = await _running(cluster, attempt=attempt)
        assert [_node_of(p) for p in pods] == placed  # n1 back and lifted before n3 is lost
        assert quarantined() == [lost] and cluster.status("train")["quarantinedNodes"] == [lost]
        (entry,) = cluster.status("train")["quarantine"]
        assert entry["reason"] == "NodeLost" and entry["until"]
        await cluster.node_ready(lost)
        cluster.clock.advance(30)  # Ready, but the quarantine has 60 s to run: kept
        await asyncio.sleep(0.6)
        assert quarantined() == [lost]
        cluster.clock.advance(31)  # expired, Ready for 61 s
        await cluster.wait(f"{lost} lifted", lambda: quarantined() == [])
        assert cluster.status("train")["phase"] == "Running"
        assert cluster.status("train")["quarantinedNodes"] == []

    def lifted() -> list[str]:
        return [e["message"] for e in cluster.events("train") if e["reason"] == "QuarantineLifted"]

    # kopf posts Events from its own queue, after the status patch that lifted the quarantine
    await cluster.wait("two QuarantineLifted Events", lambda: len(lifted()) >= 2)
    assert sorted(m.split(": ")[1].split(" (")[0] for m in lifted()) == ["n1", "n3"], lifted()
    for pod in cluster.pods("train", 2):
        await cluster.exit_pod(pod["metadata"]["name"], 0, reason="Completed")
    await cluster.wait("Succeeded", lambda: cluster.status("train").get("phase") == "Succeeded")
    assert [r["nodes"] for r in cluster.status("train")["restartHistory"]] == [["n1"], ["n3"]]


async def test_hang_restarts(cluster: Cluster) -> None:
    await cluster.apply(job_manifest(restartPolicy={"hangTimeoutSeconds": 600}))
    cluster.progress["train"] = Progress(step=5)
    await _running(cluster)
    await cluster.wait("progress time", lambda: cluster.status("train").get("lastProgressTime"))
    cluster.clock.advance(601)
    await cluster.wait("attempt 1", lambda: cluster.status("train").get("attempt") == 1)
    (rec,) = cluster.status("train")["restartHistory"]
    assert rec["reason"] == "Hang" and "hangTimeoutSeconds 600" in rec["message"]


async def test_non_retryable_exit_code_fails_without_restarting(cluster: Cluster) -> None:
    await cluster.apply(job_manifest(restartPolicy={"nonRetryableExitCodes": [3]}))
    await _running(cluster)
    await cluster.exit_pod("train-a0-n1", 3)
    await cluster.wait("phase Failed", lambda: cluster.status("train").get("phase") == "Failed")
    st = cluster.status("train")
    assert "exited with code 3" in st["message"] and "nonRetryableExitCodes" in st["message"]
    await asyncio.sleep(0.6)  # a few resync periods: still no restart
    assert cluster.status("train")["restarts"] == 0 and not cluster.pods("train", 1)
    (kept,) = cluster.pods("train", 0)  # the failed pod stays for its logs, the other stops
    assert kept["metadata"]["name"] == "train-a0-n1" and kept["status"]["phase"] == "Failed"
    failed = {x["type"]: x for x in st["conditions"]}["Failed"]
    assert failed["status"] == "True" and failed["reason"] == "UserError"


async def test_crash_loop_exhausts_the_budget(cluster: Cluster) -> None:
    await cluster.apply(job_manifest(restartPolicy={"budget": 1}))
    cluster.progress["train"] = Progress(step=3)  # it trained: a crash is not a user error
    await _running(cluster)
    await cluster.exit_pod("train-a0-n0", 1)
    await _running(cluster, attempt=1)
    assert cluster.status("train")["restartBudgetLeft"] == 0
    await cluster.exit_pod("train-a1-n0", 1)
    await cluster.wait("phase Failed", lambda: cluster.status("train").get("phase") == "Failed")
    st = cluster.status("train")
    assert st["message"].startswith("restart budget exhausted: 1 restart from the start")
    assert "PodFailed" in st["message"] and st["restarts"] == 1
    await cluster.wait("event", lambda: "RestartBudgetExhausted" in _reasons(cluster, "train"))


async def test_invalid_manifest_fails_with_field_messages(cluster: Cluster) -> None:
    doc = job_manifest(nodes=3)  # reorderGroupSize 2 does not divide 3 nodes
    doc["spec"]["trainer"]["parallelism"] = {"tensor": 3}
    await cluster.apply(doc)
    await cluster.wait("phase Failed", lambda: cluster.status("train").get("phase") == "Failed")
    st = cluster.status("train")
    assert "spec.trainer.parallelism.tensor" in st["message"]
    assert "spec.topology.reorderGroupSize" in st["message"]
    valid = {x["type"]: x for x in st["conditions"]}["Valid"]
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    await cluster.wait("InvalidSpec event", lambda: "InvalidSpec" in _reasons(cluster, "train"))
    assert not cluster.pods("train")


async def test_operator_restarted_mid_reconcile_creates_no_duplicates(cluster: Cluster) -> None:
    await cluster.stop_operator()
    gate = asyncio.Event()

    async def slow_second_pod(obj: dict[str, Any]) -> None:
        if obj["metadata"]["name"] == "train-a0-n1":
            await gate.wait()

    cluster.emu.before_create = slow_second_pod
    await cluster.apply(job_manifest())
    await cluster.start_operator()
    await cluster.wait("first pod", lambda: len(cluster.pods("train")) == 1)
    await cluster.stop_operator()  # killed while creating the second pod
    first_uid = cluster.pods("train")[0]["metadata"]["uid"]
    assert not cluster.status("train").get("phase")
    gate.set()
    await asyncio.sleep(0.1)  # the abandoned request may still land
    await cluster.start_operator()
    await _running(cluster)
    await asyncio.sleep(0.5)
    pods = cluster.pods("train")
    assert [p["metadata"]["name"] for p in pods] == ["train-a0-n0", "train-a0-n1"]
    assert pods[0]["metadata"]["uid"] == first_uid  # adopted, not recreated
    assert cluster.status("train")["restarts"] == 0


async def test_suspend_and_resume(cluster: Cluster) -> None:
    await cluster.apply(job_manifest())
    await _running(cluster)
    await cluster.patch_job("train", {"spec": {"suspend": True}})
    await cluster.wait("Suspended", lambda: cluster.status("train").get("phase") == "Suspended")
    await cluster.wait("no pods", lambda: not cluster.pods("train"))
    await cluster.patch_job("train", {"spec": {"suspend": False}})
    await _running(cluster, attempt=1)
    assert cluster.status("train")["restarts"] == 0
    assert {"Suspended", "Resumed"} <= set(_reasons(cluster, "train"))


async def test_success_and_delete_cleans_everything(cluster: Cluster) -> None:
    await cluster.apply(job_manifest())
    await _running(cluster)
    for pod in cluster.pods("train"):
        await cluster.exit_pod(pod["metadata"]["name"], 0, reason="Completed")
    await cluster.wait("Succeeded", lambda: cluster.status("train").get("phase") == "Succeeded")
    assert cluster.status("train")["completionTime"]
    await cluster.delete_job("train")
    await cluster.wait(
        "job gone",
        lambda: cluster.emu.stored_all("omni.megascale.io/v1alpha1/omnitrainingjobs") == [],
    )
    assert not cluster.pods("train")
    assert cluster.emu.stored("v1/configmaps", NS, "train-config") is None
    assert cluster.emu.stored("v1/services", NS, "train") is None


async def test_every_rbac_rule_of_the_handlers_is_used(cluster: Cluster) -> None:
    """The client refuses calls outside ``rbac.HANDLER_RULES``; this lifecycle (adoption, restart,
    deletion) needs every rule, so the chart (which grants exactly the table) grants nothing
    unused. Volcano PodGroup rules are only granted with gang scheduling and are left out."""
    from omni_operator.rbac import HANDLER_RULES

    # Left over by an earlier operator (labelled, but without an ownerReference): adopted.
    leftovers = {
        "configmaps": {"kind": "ConfigMap", "metadata": {"name": "train-config"}, "data": {}},
        "services": {
            "kind": "Service",
            "metadata": {"name": "train"},
            "spec": {"clusterIP": "None", "ports": [{"port": 29500}]},
        },
        "pods": {
            "kind": "Pod",
            "metadata": {"name": "train-a0-n0", "annotations": {ANNOTATION_NODE: "n0"}},
            "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        },
    }
    for plural, body in leftovers.items():
        body["metadata"].update(namespace=NS, labels={LABEL_JOB: "train", LABEL_ATTEMPT: "0"})
        await cluster.call(
            "POST", f"/api/v1/namespaces/{NS}/{plural}", {"apiVersion": "v1", **body}
        )
    await cluster.apply(job_manifest())
    await _running(cluster)
    await cluster.node_not_ready("n1")
    cluster.clock.advance(31)
    await _running(cluster, attempt=1)
    await cluster.delete_job("train")
    await cluster.wait(
        "all deleted",
        lambda: (
            not cluster.pods("train")
            and cluster.emu.stored("v1/configmaps", NS, "train-config") is None
            and cluster.emu.stored("v1/services", NS, "train") is None
        ),
    )
    await cluster.apply(job_manifest("fresh"))  # nothing to adopt: everything is created
    await _running(cluster, "fresh")
    used = cluster.kube_rules_used()
    volcano = {r for r in HANDLER_RULES if r[0] == "scheduling.volcano.sh"}
    assert used == HANDLER_RULES - volcano, sorted(used ^ (HANDLER_RULES - volcano))


async def test_reacts_to_watch_events_not_to_the_resync(cluster: Cluster) -> None:
    """With an hour between resyncs, every reaction here comes from a pod or Node watch event,
    or from the deadline a reconcile set (the end of a NotReady node's grace)."""
    await cluster.stop_operator()
    metrics = OperatorMetrics()
    await cluster.start_operator(resync_seconds=3600, metrics=metrics)
    cluster.progress["train"] = Progress(step=3)  # it trained: a crash is not a user error
    await cluster.apply(job_manifest(restartPolicy={"nodeLostGraceSeconds": 5}))
    await _running(cluster)  # pods Running -> condition: pod events

    await cluster.exit_pod("train-a0-n1", 1)  # a crash: pod event -> restart
    await _running(cluster, attempt=1)
    assert cluster.status("train")["restartHistory"][-1]["reason"] == "PodFailed"

    await cluster.node_not_ready("n1")  # Node event within the grace; lost 5 s later (deadline)
    await cluster.wait("attempt 2", lambda: cluster.status("train").get("attempt") == 2, 30)
    pods = await _running(cluster, attempt=2)
    assert [_node_of(p) for p in pods] == ["n2", "n3"]
    assert cluster.status("train")["restartHistory"][-1]["reason"] == "NodeLost"

    for pod in pods:
        await cluster.exit_pod(pod["metadata"]["name"], 0)
    await cluster.wait("Succeeded", lambda: cluster.status("train").get("phase") == "Succeeded")

    def reconciles(handler: str) -> float:
        count = metrics.registry.get_sample_value(
            "omni_operator_reconcile_duration_seconds_count", {"handler": handler}
        )
        return count or 0.0

    assert reconciles("resync") == 0
    assert reconciles("pod") >= 3 and reconciles("node") >= 1 and reconciles("deadline") >= 1
    pod_watches = [
        r.params for r in cluster.emu._requests  # kmock's request log
        if r.resource == kmock.resource("v1/pods") and r.params.get("watch")
    ]  # fmt: skip
    assert pod_watches  # and the API server filters them: other pods never reach the operator
    assert {p.get("labelSelector") for p in pod_watches} == {LABEL_JOB}


async def test_invalid_manifests_fail_naming_the_field_and_create_nothing(cluster: Cluster) -> None:
    """Every kind of mistake of tests/invalid_jobs.py (the same manifests `omni validate` and
    `omni render` reject), applied as the API server would store them (the emulator does no
    schema validation): each job fails at once with the field in status and an Event."""
    for name, (changes, _) in INVALID.items():
        await cluster.apply(invalid_job(job_manifest(name), changes))
    for name, (_, field) in INVALID.items():
        await cluster.wait(
            f"{name} Failed", lambda n=name: cluster.status(n).get("phase") == "Failed"
        )
        st = cluster.status(name)
        assert st["message"].startswith("invalid spec: ") and field in st["message"], st["message"]
        valid = {x["type"]: x for x in st["conditions"]}["Valid"]
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
        await cluster.wait(f"{name} Event", lambda n=name: "InvalidSpec" in _reasons(cluster, n))
        (event,) = [e for e in cluster.events(name) if e["reason"] == "InvalidSpec"]
        assert event["type"] == "Warning" and field in event["message"]
        assert not cluster.pods(name)
    assert not cluster.emu.stored_all("v1/pods", NS)
