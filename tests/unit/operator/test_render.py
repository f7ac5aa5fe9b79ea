"""Rendering: valid Kubernetes objects, wired for torchrun, pinned to the placed nodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from omni_operator.placement import place
from omni_operator.render import (
    CONFIG_FILE,
    LABEL_JOB,
    render_all,
    render_config_map,
)
from omni_operator.spec import OmniTrainingJob, parse_job
from omni_trainer.config import ManifestError, parse_manifest

from ...conftest import EXAMPLES
from .nodes import SPINE, ZONE, cluster

DATA = Path(__file__).parent / "data"
K8S_VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]


def _job(uid: str | None = "5f1c-uid", **spec: Any) -> OmniTrainingJob:
    doc = yaml.safe_load((EXAMPLES / "paper-workload-a.yaml").read_text())
    doc["metadata"].update(namespace="ml", **({"uid": uid} if uid else {}))
    doc["spec"].update(
        nodes=4,
        gpusPerNode=8,
        topology={"networkDomainLabels": [ZONE, SPINE], "reorderGroupSize": 2},
    )
    doc["spec"].update(spec)
    doc["spec"]["trainer"]["data"]["globalBatchSize"] = 16
    return parse_job(doc)


RDMA = {
    "resources": {
        "rdma": {"resourceName": "rdma/ib", "count": 1},
        "cpu": 96,
        "memory": "1000Gi",
        "shmSize": "128Gi",
    },
    "nccl": {"ibHca": "mlx5_0,mlx5_1", "socketIfname": "eth0", "env": {"NCCL_DEBUG": "WARN"}},
    "scheduling": {
        "volcanoGang": True,
        "priorityClassName": "training",
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
    },
}


def _objects(job: OmniTrainingJob, attempt: int = 0) -> list[dict[str, Any]]:
    nodes = cluster({("z1", "a"): 2, ("z1", "b"): 2, ("z2", "c"): 4})
    for n in nodes:
        n["metadata"]["labels"]["kubernetes.io/os"] = "linux"
        n["status"]["allocatable"]["rdma/ib"] = "1"
    return render_all(job, place(nodes, job.spec), attempt=attempt)


CASES = {
    "plain": {},
    "rdma-volcano": RDMA,
    "kueue": {"scheduling": {"kueueQueue": "team-a", "schedulerName": "default-scheduler"}},
    "kueue-topology": {"scheduling": {"kueueQueue": "team-a", "topologyAware": True}},
    "volcano-topology": {"scheduling": {"volcanoGang": True, "topologyAware": True}},
    "no-uid": None,
    "storage": {
        "envFrom": [{"secretRef": {"name": "s3-credentials"}}, {"configMapRef": {"name": "hf"}}],
        "volumes": [
            {"name": "data", "claimName": "datasets", "mountPath": "/data", "readOnly": True},
            {"name": "ckpt", "claimName": "ckpt", "mountPath": "/ckpt", "subPath": "team-a"},
            {"name": "aws", "secretName": "s3-files", "mountPath": "/var/run/secrets/s3"},
        ],
        "imagePullSecrets": ["nvcr"],
    },
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_objects_pass_kubernetes_validate_strict(case: str, version: str) -> None:
    job = _job(uid=None) if CASES[case] is None else _job(**CASES[case])
    objs = _objects(job, attempt=3)
    kinds = [o["kind"] for o in objs]
    assert kinds[:2] == ["ConfigMap", "Service"] and kinds.count("Pod") == 4
    for obj in objs:
        if obj["apiVersion"].startswith("scheduling.volcano.sh/"):
            assert obj["spec"]["minMember"] == 4  # a CRD kubernetes-validate does not know
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_pods_are_wired_for_torchrun() -> None:
    job = _job()
    objs = _objects(job, attempt=2)
    pods = [o for o in objs if o["kind"] == "Pod"]
    master = "paper-a-a2-rdzv.ml.svc"
    # The rendezvous address is a Service selecting the attempt's pod of node rank 0 (a spare
    # relabelled to that rank included); it publishes the pod before it is Ready.
    (rdzv,) = [o for o in objs if o["metadata"]["name"] == "paper-a-a2-rdzv"]
    assert rdzv["spec"]["clusterIP"] == "None" and rdzv["spec"]["publishNotReadyAddresses"]
    selector = rdzv["spec"]["selector"]
    selected = [p["metadata"]["name"] for p in pods
                if selector.items() <= p["metadata"]["labels"].items()]  # fmt: skip
    assert selected == ["paper-a-a2-n0"]
    for rank, pod in enumerate(pods):
        spec = pod["spec"]
        (container,) = spec["containers"]
        assert pod["metadata"]["name"] == spec["hostname"] == f"paper-a-a2-n{rank}"
        # In place (the default): the kubelet restarts a dead container, the supervisor its
        # trainer for each attempt the pod's order annotation names (a downwardAPI file, which
        # a kubelet rewrites as soon as the pod is updated); its state outlives the container.
        assert spec["subdomain"] == "paper-a" and spec["restartPolicy"] == "OnFailure"
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the cause
        sup, cmd = container["command"][:7], container["command"][7:]
        assert sup == ["omni", "supervise", "--attempt-file=/etc/omni-order/attempt",
                       "--state-dir=/var/run/omni", "--report-port=9465", "--warm",
                       "--"]  # fmt: skip
        # A failed attempt turns the pod unready (its supervisor's /healthz) instead of ending
        # the container, which keeps running for the next attempt.
        probe = container["readinessProbe"]
        assert probe["httpGet"] == {"path": "/healthz", "port": "supervisor"}
        assert (probe["periodSeconds"], probe["failureThreshold"]) == (1, 1)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["supervisor"] == 9465 and ports["metrics"] == 9464
        assert {"name": "supervisor", "mountPath": "/var/run/omni"} in container["volumeMounts"]
        order = pod["metadata"]["annotations"]["omni.megascale.io/order"]
        assert json.loads(order) == {"attempt": 2, "pods": 2}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (item,) = volumes["order"]["downwardAPI"]["items"]
        assert item == {"path": "attempt", "fieldRef": {
            "fieldPath": "metadata.annotations['omni.megascale.io/order']"}}  # fmt: skip
        mount = {"name": "order", "mountPath": "/etc/omni-order", "readOnly": True}
        assert mount in container["volumeMounts"]
        assert cmd[:4] == ["torchrun", "--nnodes=4", f"--node-rank={rank}", "--nproc-per-node=8"]
        assert f"--master-addr={master}" in cmd and cmd[-2:] == ["train", "/etc/omni/job.yaml"]
        assert cmd[-4:-2] == ["-m", "omni_trainer.warm"]  # workers fork from a warm trainer
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OMNI_NODE_RANK"] == str(rank) and env["OMNI_RESTART_ATTEMPT"] == "2"
        assert env["OMNI_RESUME"] == "auto" and env["MASTER_ADDR"] == master
        assert env["OMNI_PIPELINE_STAGES"] == str(rank // 2)
        assert env["OMNI_REORDER_GROUP"] == str(rank // 2)
        assert env["NCCL_IB_DISABLE"] == "1"  # no RDMA asked for
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (field,) = terms["nodeSelectorTerms"][0]["matchFields"]
        assert field["values"] == [pod["metadata"]["annotations"]["omni.megascale.io/placed-node"]]
        assert spec["securityContext"]["runAsNonRoot"] is True
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "OmniTrainingJob",
            "5f1c-uid",
            True,
        )
        assert pod["metadata"]["labels"][LABEL_JOB] == "paper-a"
    placed = [p["metadata"]["annotations"]["omni.megascale.io/placed-node"] for p in pods]
    assert len(set(placed)) == 4
    (config,) = [o for o in _objects(job, attempt=2) if o["kind"] == "ConfigMap"]
    assert json.loads(config["data"]["attempt"]) == {"attempt": 2, "pods": 2}

    recreate = _job(restartPolicy={"mode": "recreate"})
    for pod in [o for o in _objects(recreate, attempt=2) if o["kind"] == "Pod"]:
        (container,) = pod["spec"]["containers"]
        assert pod["spec"]["restartPolicy"] == "Never" and container["command"][0] == "torchrun"
        assert container["command"][-4:-2] == ["-m", "omni_trainer.cli"]  # cold: a new container
        assert all(v["name"] not in ("supervisor", "order") for v in pod["spec"]["volumes"])
        assert "omni.megascale.io/order" not in pod["metadata"]["annotations"]
        assert "readinessProbe" not in container  # no supervisor to report: the container ends
        assert [p["name"] for p in container["ports"]] == ["rendezvous", "metrics"]


def test_rdma_nccl_shm_and_gang_settings() -> None:
    objs = _objects(_job(**RDMA))
    group = next(o for o in objs if o["kind"] == "PodGroup")
    pod = next(o for o in objs if o["kind"] == "Pod")
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and env["NCCL_IB_DISABLE"] == "0"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_DEBUG"] == "WARN"
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": "8", "rdma/ib": "1", "memory": "1000Gi"},
        "requests": {"nvidia.com/gpu": "8", "rdma/ib": "1", "cpu": "96", "memory": "1000Gi"},
    }
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    assert pod["spec"]["schedulerName"] == "volcano"
    assert (
        pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
    )
    tolerations = pod["spec"]["tolerations"]
    assert tolerations[0] == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert {t["key"]: t["tolerationSeconds"] for t in tolerations[1:]} == {
        "node.kubernetes.io/not-ready": 60,
        "node.kubernetes.io/unreachable": 60,
    }


def test_kueue_pod_group_labels() -> None:
    pods = [o for o in _objects(_job(scheduling={"kueueQueue": "team-a"})) if o["kind"] == "Pod"]
    for pod in pods:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "paper-a-a0"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "4"


def _kueue_tas(group: int) -> list[dict[str, Any]]:
    job = _job(
        scheduling={"kueueQueue": "team-a", "topologyAware": True},
        topology={"networkDomainLabels": [ZONE, SPINE], "reorderGroupSize": group},
    )
    return [o for o in _objects(job) if o["kind"] == "Pod"]


def test_kueue_topology_aware_scheduling_follows_the_reorder_groups() -> None:
    """Two reorder groups of two nodes: each a slice inside one spine, the job as close as it
    fits; pods indexed by node rank, so a slice is two consecutive ranks; Kueue picks the
    nodes (no pin, so the gang is one PodSet)."""
    pods = _kueue_tas(group=2)
    assert [p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-pod-index"] for p in pods] == [
        "0", "1", "2", "3"
    ]  # fmt: skip
    for pod in pods:
        tas = {k: v for k, v in pod["metadata"]["annotations"].items() if "podset" in k}
        assert tas == {
            "kueue.x-k8s.io/podset-preferred-topology": SPINE,
            "kueue.x-k8s.io/podset-slice-required-topology": SPINE,
            "kueue.x-k8s.io/podset-slice-size": "2",
        }
        assert "affinity" not in pod["spec"]


def test_kueue_topology_of_one_reorder_group_is_required() -> None:
    for pod in _kueue_tas(group=4):
        tas = {k: v for k, v in pod["metadata"]["annotations"].items() if "podset" in k}
        assert tas == {"kueue.x-k8s.io/podset-required-topology": SPINE}


def test_kueue_without_topology_awareness_keeps_the_pin_and_no_tas() -> None:
    for pod in (
        o for o in _objects(_job(scheduling={"kueueQueue": "team-a"})) if o["kind"] == "Pod"
    ):
        meta = pod["metadata"]
        assert not [k for k in {**meta["labels"], **meta["annotations"]} if "podset" in k
                    or k == "kueue.x-k8s.io/pod-group-pod-index"]  # fmt: skip
        assert pod["spec"]["affinity"]["nodeAffinity"]


def test_volcano_pod_group_network_topology_queue_and_priority() -> None:
    sched = {**RDMA["scheduling"], "topologyAware": True, "volcanoQueue": "research"}
    objs = _objects(_job(**{**RDMA, "scheduling": sched}))
    group = next(o for o in objs if o["kind"] == "PodGroup")
    assert group["spec"] == {
        "minMember": 4,
        "queue": "research",
        "priorityClassName": "training",
        "networkTopology": {"mode": "soft"},
        "subGroupPolicy": [
            {
                "name": "reorder-group",
                "subGroupSize": 2,
                "labelSelector": {
                    "matchExpressions": [
                        {"key": "omni.megascale.io/reorder-group", "operator": "Exists"}
                    ]
                },
                "matchLabelKeys": ["omni.megascale.io/reorder-group"],
                "networkTopology": {"mode": "hard", "highestTierAllowed": 1},
            }
        ],
    }
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert [p["metadata"]["labels"]["omni.megascale.io/reorder-group"] for p in pods] == [
        "0", "0", "1", "1"
    ]  # fmt: skip
    assert all(p["spec"]["affinity"]["nodeAffinity"] for p in pods)  # Volcano sees one gang


def test_volcano_network_topology_of_one_reorder_group_is_hard() -> None:
    sched = {**RDMA["scheduling"], "topologyAware": True}
    job = _job(**{**RDMA, "scheduling": sched},
               topology={"networkDomainLabels": [ZONE, SPINE], "reorderGroupSize": 4})  # fmt: skip
    group = next(o for o in _objects(job) if o["kind"] == "PodGroup")
    assert group["spec"] == {
        "minMember": 4,
        "priorityClassName": "training",
        "networkTopology": {"mode": "hard", "highestTierAllowed": 1},
    }


def test_config_map_is_a_manifest_the_trainer_reads() -> None:
    job = _job()
    data = render_config_map(job)["data"][CONFIG_FILE]
    manifest = parse_manifest(yaml.safe_load(data))
    # 4 nodes, pipeline 2: a 2-node reorder group is a whole stage = all 4 data-parallel ranks.
    reorder = job.spec.trainer.data.reorder.model_copy(update={"group_size": 4})
    data_cfg = job.spec.trainer.data.model_copy(update={"reorder": reorder})
    assert manifest.spec.trainer == job.spec.trainer.model_copy(update={"data": data_cfg})
    assert set(yaml.safe_load(data)["spec"]) == {"trainer"}  # cluster settings stay out


def test_the_trainers_get_the_manifests_preflight_settings() -> None:
    """The trainers run the network preflight: the settings a user wrote reach them (before,
    the pods' manifest dropped spec.preflight and every job ran the defaults)."""
    settings = {"enabled": False, "sizeMb": 2, "minFractionOfMedian": 0.9}
    data = render_config_map(_job(preflight=settings))["data"][CONFIG_FILE]
    assert yaml.safe_load(data)["spec"]["preflight"] == settings
    from omni_trainer.distributed.netcheck_rules import PreflightConfig

    cfg = PreflightConfig.model_validate(
        parse_manifest(yaml.safe_load(data)).spec.model_extra["preflight"]
    )
    assert (cfg.enabled, cfg.size_mb, cfg.min_fraction_of_median) == (False, 2, 0.9)


def test_reorder_groups_follow_the_network_local_node_groups() -> None:
    """G consecutive nodes of a stage hold G x gpus / tensor consecutive data-parallel ranks."""
    assert _job(nodes=8).spec.trainer_reorder_group() == 2 * 8 // 4  # 4 nodes per stage, G=2
    assert _job().spec.trainer_reorder_group() == 4  # G = a whole stage: all data parallel
    with pytest.raises(ManifestError, match=r"groupSize \(3\) disagrees with topology"):
        doc = yaml.safe_load((EXAMPLES / "paper-workload-a.yaml").read_text())
        doc["spec"].update(nodes=8, gpusPerNode=8, topology={"reorderGroupSize": 2})
        doc["spec"]["trainer"]["data"].update(globalBatchSize=16, reorder={"groupSize": 3})
        parse_job(doc)


def test_no_owner_reference_without_uid() -> None:
    for obj in _objects(_job(uid=None)):
        assert "ownerReferences" not in obj["metadata"]


def test_cli_render_prints_objects_and_explanation() -> None:
    from omni_trainer.cli import app

    manifest = DATA / "vlm-16.yaml"
    result = CliRunner().invoke(
        app, ["render", str(manifest), "--nodes", str(DATA / "nodes-16.yaml"), "--quarantine", "n5"]
    )
    assert result.exit_code == 0, result.output
    head, *docs = result.stdout.split("\n---\n")
    assert "# reorder group 0 (node ranks 0-1, pipeline stage 0)" in head
    assert "n5 quarantined" in head and "n2 NotReady" in head
    objs = [yaml.safe_load(d) for d in docs]
    kinds = ["ConfigMap", "Service", "Service", "PodGroup"] + ["Pod"] * 8
    assert [o["kind"] for o in objs] == kinds
    assert "n5" not in {
        o["metadata"].get("annotations", {}).get("omni.megascale.io/placed-node") for o in objs
    }


def test_cli_render_explains_failures(tmp_path: Path) -> None:
    from omni_trainer.cli import app

    runner = CliRunner()
    nodes = str(DATA / "nodes-16.yaml")
    result = runner.invoke(
        app,
        [
            "render",
            str(DATA / "vlm-16.yaml"),
            "--nodes",
            nodes,
            "--quarantine",
            "n0",
            "--quarantine",
            "n4",
            "--quarantine",
            "n8",
            "--quarantine",
            "n12",
            "--quarantine",
            "n1",
        ],
    )
    assert result.exit_code == 1
    assert "cannot be placed" in result.stderr and "n1 quarantined" in result.stderr
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((DATA / "vlm-16.yaml").read_text())
    doc["spec"]["nodes"] = 3
    bad.write_text(yaml.safe_dump(doc))
    result = runner.invoke(app, ["render", str(bad), "--nodes", nodes])
    assert result.exit_code == 2
    assert "spec.trainer.parallelism.pipeline:" in result.stderr


def test_the_validator_is_strict_enough_to_catch_mistakes() -> None:
    pod = next(o for o in _objects(_job()) if o["kind"] == "Pod")
    pod["spec"]["containers"][0]["resource"] = {}  # a typo of "resources"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSIONS[0], strict=True)


def test_trainer_pods_expose_the_trainers_metrics_port() -> None:
    """The PodMonitor scrapes the port named ``metrics``; the trainer serves on the env's port."""
    from omni_operator.render import METRICS_PORT
    from omni_trainer.components.metrics import DEFAULT_PORT

    assert METRICS_PORT == DEFAULT_PORT
    pods = [o for o in _objects(_job()) if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert ports["metrics"] == DEFAULT_PORT and env["OMNI_METRICS_PORT"] == str(DEFAULT_PORT)


def test_trainer_pods_are_not_best_effort_and_mount_no_token() -> None:
    """Requests default to 90% of the node's allocatable CPU and memory (the manifest's own win);
    the trainer never calls the API server, so no service-account token is mounted."""
    job = _job()
    (pod, *_) = [o for o in _objects(job) if o["kind"] == "Pod"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    requests = pod["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "86400m" and requests["memory"] == "943718Mi"  # 96 CPUs, 1Ti
    assert "memory" not in pod["spec"]["containers"][0]["resources"]["limits"]
    (pod, *_) = [o for o in _objects(_job(**RDMA)) if o["kind"] == "Pod"]
    requests = pod["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "96" and requests["memory"] == "1000Gi"


def test_the_vlm_recipe_runs_over_infiniband_with_credentials_from_a_secret() -> None:
    """examples/vlm-7b.yaml: IB on (8 HCAs), S3 credentials only through the Secret, the LLM read
    on the pods (the operator does not open s3://models)."""
    job = parse_job(yaml.safe_load((EXAMPLES / "vlm-7b.yaml").read_text()))
    assert not job.spec.trainer.model.llm.resolved
    pods = [o for o in _objects(job) if o["kind"] == "Pod"]
    assert len(pods) == 8
    for pod in pods:
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert env["NCCL_IB_HCA"] == ",".join(f"mlx5_{i}" for i in range(8))
        assert not [k for k in env if k.startswith("AWS_")]  # credentials: the Secret only
        assert c["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
        assert c["resources"]["limits"]["rdma/ib"] == "1"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_storage_and_credentials_reach_every_trainer_pod() -> None:
    pods = [o for o in _objects(_job(**CASES["storage"])) if o["kind"] == "Pod"]
    for pod in pods:
        (c,) = pod["spec"]["containers"]
        assert c["envFrom"] == CASES["storage"]["envFrom"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
        assert mounts["ckpt"]["subPath"] == "team-a" and "dshm" in mounts and "config" in mounts
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        claim = volumes["data"]["persistentVolumeClaim"]
        assert claim == {"claimName": "datasets", "readOnly": True}
        assert volumes["aws"]["secret"] == {"secretName": "s3-files"} and mounts["aws"]["readOnly"]
        assert pod["spec"]["imagePullSecrets"] == [{"name": "nvcr"}]


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ({"volumes": [{"name": "config", "claimName": "c", "mountPath": "/x"}]},
         "spec.volumes[0].name: 'config' is the operator's name; choose another"),
        ({"volumes": [{"name": "a", "claimName": "c", "mountPath": "/dev/shm/x"}]},
         "spec.volumes[0].mountPath: /dev/shm/x overlaps /dev/shm; mount elsewhere"),
        ({"volumes": [{"name": "a", "claimName": "c", "mountPath": "/d"},
                      {"name": "b", "claimName": "c", "mountPath": "/d/e"}]},
         "spec.volumes[1].mountPath: /d/e overlaps /d; mount elsewhere"),
        ({"volumes": [{"name": "a", "claimName": "c", "mountPath": "data"}]},
         "spec.volumes.0.mountPath"),
        ({"volumes": [{"name": "a", "claimName": "c", "secretName": "s", "mountPath": "/d"}]},
         "spec.volumes[0]: set exactly one of claimName and secretName"),
        ({"envFrom": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]},
         "spec.envFrom[0]: set exactly one of secretRef and configMapRef"),
        ({"imagePullSecrets": ["Bad_Name"]}, "spec.imagePullSecrets"),
    ],
)  # fmt: skip
def test_bad_storage_settings_name_the_field(spec: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ManifestError) as err:
        _job(**spec)
    assert complaint.replace(".0.", "[0].") in str(err.value), str(err.value)


def test_the_fast_checkpoint_tier_is_a_hostpath_per_job_on_each_node() -> None:
    doc = yaml.safe_load((EXAMPLES / "paper-workload-a.yaml").read_text())
    doc["metadata"]["namespace"] = "ml"
    doc["spec"]["trainer"]["checkpoint"] = {
        "path": "/ckpt/run",
        "intervalSteps": 100,
        "fast": {"path": "/var/lib/omni-fast", "intervalSteps": 10},
    }
    job = parse_job(doc)
    pods = [o for o in _objects(job) if o["kind"] == "Pod"]
    for pod in pods:
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "fast-checkpoints"]
        assert volume["hostPath"] == {
            "path": f"/var/lib/omni-fast/ml/{job.metadata.name}",
            "type": "DirectoryOrCreate",
        }
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "fast-checkpoints", "mountPath": "/var/lib/omni-fast"} in mounts
    plain = [o for o in _objects(_job()) if o["kind"] == "Pod"]
    assert all(v["name"] != "fast-checkpoints" for p in plain for v in p["spec"]["volumes"])
