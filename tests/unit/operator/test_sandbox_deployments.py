"""The sandbox's Deployment emulation (pure parts), the kubelet's image entrypoints and pod
addresses, and the protobuf Secrets Helm writes."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from omni_operator.sandbox import protobuf
from omni_operator.sandbox.cluster import OPERATOR_ENTRYPOINT, node_object
from omni_operator.sandbox.deployments import (
    HASH_LABEL,
    deployment_status,
    plan,
    pod_for,
    template_hash,
)
from omni_operator.sandbox.kubelet.api import ApiClient
from omni_operator.sandbox.kubelet.command import container_argv
from omni_operator.sandbox.kubelet.images import ImageConfig
from omni_operator.sandbox.kubelet.network import own_address
from omni_operator.sandbox.kubelet.node import SimNode
from omni_operator.sandbox.kubelet.scheduler import Scheduler
from omni_operator.sandbox.kubelet.volumes import automount

REPO = Path(__file__).resolve().parents[3]


def _deploy(replicas: int = 1, image: str = "op:1") -> dict:
    template = {
        "metadata": {"labels": {"app": "op"}, "annotations": {"a": "b"}},
        "spec": {"containers": [{"name": "operator", "image": image, "args": ["--x"]}]},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "omni", "namespace": "ns", "uid": "u-1", "generation": 3},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "op"}},
                 "template": template},
    }  # fmt: skip


def _pod(deploy: dict, *, phase: str = "Running", ready: bool = True, **meta: object) -> dict:
    pod = pod_for(deploy)
    pod["metadata"].update(meta)
    pod["status"] = {"phase": phase, "containerStatuses": [{"name": "operator", "ready": ready}]}
    return pod


def test_pods_are_named_labelled_and_owned_like_a_deployments() -> None:
    d = _deploy()
    pod = pod_for(d, suffix="abcde")
    digest = template_hash(d["spec"]["template"])
    assert re.fullmatch(r"[bcdfghjklmnpqrstvwxz2456789]{10}", digest)
    assert pod["metadata"]["name"] == f"omni-{digest}-abcde"
    assert pod["metadata"]["labels"] == {"app": "op", HASH_LABEL: digest}
    assert pod["metadata"]["annotations"] == {"a": "b"}
    (owner,) = pod["metadata"]["ownerReferences"]
    assert owner == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "omni", "uid": "u-1",
                     "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    assert pod["spec"] == d["spec"]["template"]["spec"]
    assert pod_for(d)["metadata"]["name"] != pod_for(d)["metadata"]["name"]  # random suffix
    assert template_hash(_deploy(image="op:2")["spec"]["template"]) != digest


def test_plan_creates_replaces_and_trims() -> None:
    d = _deploy(replicas=2)
    assert plan(d, []).create == 2
    one = _pod(d)
    assert plan(d, [one]).create == 1
    failed = _pod(d, phase="Failed")
    todo = plan(d, [one, failed])  # an ended pod is deleted and replaced
    assert todo.create == 1 and todo.delete == (failed["metadata"]["name"],)
    going = _pod(d, deletionTimestamp="2026-01-01T00:00:00Z")
    assert plan(d, [one, going]).create == 1  # a terminating pod is not counted
    three = [_pod(d), _pod(d, ready=False), _pod(d)]
    trimmed = plan(_deploy(replicas=2), three)
    assert trimmed.create == 0 and trimmed.delete == (three[1]["metadata"]["name"],)  # unready


def test_a_new_template_recreates_old_pods_first() -> None:
    old = _pod(_deploy(image="op:1"))
    new = _deploy(image="op:2")
    todo = plan(new, [old])
    assert todo.create == 0 and todo.delete == (old["metadata"]["name"],)
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert plan(new, [old]).create == 0  # still stopping: no overlap (kopf runs once)
    assert plan(new, []).create == 1


def test_status_counts_ready_and_available_replicas() -> None:
    d = _deploy(replicas=1)
    status = deployment_status(d, [_pod(d, ready=False)], now="t0")
    assert (status["replicas"], status["updatedReplicas"], status["readyReplicas"],
            status["availableReplicas"]) == (1, 1, 0, 0)  # fmt: skip
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Available"]["status"] == "False" and status["observedGeneration"] == 3
    d["status"] = status
    ready = deployment_status(d, [_pod(d)], now="t1")
    conds = {c["type"]: c for c in ready["conditions"]}
    assert ready["availableReplicas"] == 1 and conds["Available"]["status"] == "True"
    assert conds["Available"]["lastTransitionTime"] == "t1"
    assert conds["Progressing"]["reason"] == "NewReplicaSetAvailable"


def test_a_container_without_command_runs_its_images_entrypoint() -> None:
    image = ImageConfig(entrypoint=("kopf", "run"), cmd=("--standalone",))
    assert container_argv({"args": ["--a"]}, image) == ["kopf", "run", "--a"]
    assert container_argv({}, image) == ["kopf", "run", "--standalone"]
    assert container_argv({"command": ["sh"], "args": ["-c"]}, image) == ["sh", "-c"]
    assert container_argv({"command": ["sh"]}, image) == ["sh"]  # CMD dropped
    assert container_argv({"args": ["x"]}, None) == ["x"]


def test_the_operator_images_entrypoint_is_the_dockerfiles() -> None:
    text = (REPO / "dockerfiles" / "operator.Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entry and cmd
    assert list(OPERATOR_ENTRYPOINT.entrypoint) == json.loads(entry.group(1))
    assert list(OPERATOR_ENTRYPOINT.cmd) == json.loads(cmd.group(1))


def test_any_address_is_the_pods_own_and_tokens_mount_unless_refused() -> None:
    ip = "127.9.1.3"
    assert own_address("--liveness=http://0.0.0.0:8080/healthz", ip) == (
        f"--liveness=http://{ip}:8080/healthz"
    )
    assert own_address("10.0.0.0/8", ip) == "10.0.0.0/8"
    assert automount({"spec": {}}) and not automount(
        {"spec": {"automountServiceAccountToken": False}}
    )


def _field(number: int, value: bytes | int) -> bytes:
    def varint(n: int) -> bytes:
        out = b""
        while True:
            low, n = n & 0x7F, n >> 7
            out += bytes([low | (0x80 if n else 0)])
            if not n:
                return out

    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def _entry(key: str, value: bytes) -> bytes:
    return _field(1, key.encode()) + _field(2, value)


def test_protobuf_secrets_and_configmaps_decode_to_their_json() -> None:
    meta = _field(1, b"sh.helm.release.v1.omni.v1") + _field(3, b"omni-system")
    meta += _field(11, _entry("owner", b"helm")) + _field(11, _entry("status", b"deployed"))
    secret = _field(1, meta) + _field(2, _entry("release", b"\x00\xffdata"))
    secret += _field(3, b"helm.sh/release.v1") + _field(5, 1)
    envelope = _field(1, _field(1, b"v1") + _field(2, b"Secret")) + _field(2, secret)
    obj = protobuf.decode(protobuf.MAGIC + envelope)
    assert obj == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "sh.helm.release.v1.omni.v1", "namespace": "omni-system",
                     "labels": {"owner": "helm", "status": "deployed"}},
        "data": {"release": base64.b64encode(b"\x00\xffdata").decode()},
        "type": "helm.sh/release.v1",
        "immutable": True,
    }  # fmt: skip
    cm = _field(1, _field(1, b"c")) + _field(2, _entry("k", b"v"))
    envelope = _field(1, _field(1, b"v1") + _field(2, b"ConfigMap")) + _field(2, cm)
    assert protobuf.decode(protobuf.MAGIC + envelope) == {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}
    }  # fmt: skip
    pod = _field(1, _field(1, b"v1") + _field(2, b"Pod")) + _field(2, b"")
    assert protobuf.decode(protobuf.MAGIC + pod) is None
    assert protobuf.decode(b"{}") is None


def test_a_pod_naming_no_node_goes_to_the_least_allocated_that_fits() -> None:
    nodes = {f"node-{i}": node_object(f"node-{i}", gpus=0, spine="s", cpu=2) for i in range(3)}
    nodes["node-2"]["metadata"]["labels"]["pool"] = "infra"
    scheduler = Scheduler(ApiClient("http://127.0.0.1:1"),
                          [SimNode(name, i, 0) for i, name in enumerate(nodes)])  # fmt: skip
    pod = {"spec": {"containers": [{"resources": {"requests": {"cpu": "500m"}}}]}}
    assert scheduler.pick(pod, nodes) == "node-0"  # a tie: the first
    scheduler.held = {"node-0": {"cpu": 1.0}}
    assert scheduler.pick(pod, nodes) == "node-1"
    assert scheduler.pick({**pod, "spec": {**pod["spec"], "nodeSelector": {"pool": "infra"}}},
                          nodes) == "node-2"  # fmt: skip
    big = {"spec": {"containers": [{"resources": {"requests": {"cpu": "3"}}}]}}
    assert scheduler.pick(big, nodes) is None
