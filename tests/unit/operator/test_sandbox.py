"""The sandbox's pure parts: what the kubelet simulator reads from a rendered pod, how it
localizes paths and cluster names, and the Tables `kubectl get` prints."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import yaml

from omni_operator.capacity import pinned_node, pod_requests
from omni_operator.crd import crd
from omni_operator.placement import place
from omni_operator.render import CONFIG_DIR, CONFIG_PATH, render_all
from omni_operator.sandbox.kubelet.backoff import crash_backoff
from omni_operator.sandbox.kubelet.network import Network, localize, map_service_ports
from omni_operator.sandbox.tables import age, as_table, printer_columns
from omni_operator.spec import OmniTrainingJobSpec, parse_job

from ...conftest import EXAMPLES
from .nodes import cluster


def _pods() -> list[dict]:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"].update(namespace="ml")
    doc["spec"].update(nodes=2, gpusPerNode=2)
    doc["spec"]["trainer"]["data"]["microBatchSize"] = 2
    job = parse_job(doc)
    placement = place(cluster({("z1", "a"): 4}), job.spec)
    return [o for o in render_all(job, placement, attempt=3) if o["kind"] == "Pod"]


def test_the_kubelet_reads_the_node_and_gpus_the_operator_rendered() -> None:
    pods = _pods()
    assert [pinned_node(p) for p in pods] == [
        p["metadata"]["annotations"]["omni.megascale.io/placed-node"] for p in pods
    ]
    assert [pod_requests(p)["nvidia.com/gpu"] for p in pods] == [2, 2]
    assert pinned_node({"spec": {"nodeSelector": {"kubernetes.io/hostname": "n7"}}}) == "n7"
    assert pinned_node({"spec": {}}) is None


def test_mounts_and_cluster_names_become_local(tmp_path: Path) -> None:
    mounts = {CONFIG_DIR: tmp_path / "config"}
    assert localize(CONFIG_PATH, mounts) == str(tmp_path / "config" / "job.yaml")
    assert localize(f"--config={CONFIG_PATH}", mounts).endswith("/config/job.yaml")
    assert localize("--master-addr=train-a3-n0.train.ml.svc", mounts) == "--master-addr=127.0.0.1"
    assert localize("rank0.train.ml.svc.cluster.local:29500", {}) == "127.0.0.1:29500"
    assert localize("/etc/omnibus", mounts) == "/etc/omnibus"  # a prefix is not a mount


def test_each_service_gets_its_own_stable_local_port() -> None:
    net = Network(subnet=0)
    words = [p["spec"]["containers"][0]["command"] for p in _pods()]
    envs = [{e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"] if "value" in e}
            for p in _pods()]  # fmt: skip
    for w, e in zip(words, envs, strict=True):
        map_service_ports(w, e, net)
    ports = {next(x for x in w if x.startswith("--master-port=")) for w in words}
    assert len(ports) == 1 and ports != {"--master-port=29500"}  # both pods agree, remapped
    assert {e["MASTER_PORT"] for e in envs} == {ports.pop().split("=")[1]}
    other = net.port("other-a0-n0.other.ml.svc", 29500)
    assert str(other) != envs[0]["MASTER_PORT"]
    assert net.port("other-a0-n0.other.ml.svc", 29500) == other
    assert net.pod_ip(0) == "127.0.1.1" and net.pod_ip(0) == "127.0.1.2"
    assert net.pod_ip(2) == "127.0.3.1" and net.host_ip(2) == "127.0.3.0"
    assert Network(subnet=7).pod_ip(1) == "127.7.2.1"  # another sandbox, other addresses


def test_age_prints_like_kubectl() -> None:
    now = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)

    def ago(seconds: int) -> str:
        t = now - dt.timedelta(seconds=seconds)
        return age(t.strftime("%Y-%m-%dT%H:%M:%SZ"), now)

    assert [ago(5), ago(119), ago(125), ago(300), ago(3000), ago(7200), ago(3 * 86400)] == [
        "5s", "119s", "2m5s", "5m", "50m", "120m", "3d"
    ]  # fmt: skip
    assert age(None) == "<unknown>"
    # as clients post times (kopf's Events): fractions and an offset
    assert age((now - dt.timedelta(seconds=42)).isoformat(), now) == "42s"
    assert age("2026-12-02T11:58:59.706133+00:00", now) == "60s"
    assert age("yesterday", now) == "<invalid>"


def test_crd_printer_columns_become_a_table() -> None:
    job = {
        "metadata": {"name": "train", "creationTimestamp": "2026-12-02T12:00:00Z"},
        "spec": {"nodes": 2},
        "status": {"phase": "Running", "step": 42, "restarts": 1},
    }
    table = as_table([job], printer_columns(crd()), resource_version="7")
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names[:3] == ["Name", "Phase", "Step"] and "Restarts" in names
    (row,) = table["rows"]
    cells = dict(zip(names, row["cells"], strict=True))
    assert cells["Name"] == "train" and cells["Phase"] == "Running" and cells["Step"] == 42
    assert cells["Restarts"] == 1 and cells["Nodes"] == 2 and cells["MFU"] is None
    assert row["object"]["metadata"]["name"] == "train"


def _cells(obj: dict, kind: str) -> dict:
    from omni_operator.sandbox.tables import BUILTIN

    table = as_table([obj], BUILTIN[kind], resource_version="1")
    names = [c["name"] for c in table["columnDefinitions"]]
    return dict(zip(names, table["rows"][0]["cells"], strict=True))


def test_pods_and_services_print_as_kubectl_prints_them() -> None:
    """STATUS is a container's waiting or termination reason before the phase (a user sees
    ContainerCreating, ErrImagePull, CrashLoopBackOff), RESTARTS counts the containers'
    restarts (an in-place restart shows there); Services show type, ports and selector."""
    meta = {"name": "p", "creationTimestamp": "2026-12-02T12:00:00Z"}
    spec = {"containers": [{"name": "trainer"}]}

    def pod(phase: str, cs: dict, **extra: object) -> dict:
        status = {"phase": phase, "containerStatuses": [{"name": "trainer", **cs}]}
        return {"metadata": {**meta, **extra}, "spec": spec, "status": status}

    pulling = {"state": {"waiting": {"reason": "ContainerCreating"}}, "restartCount": 0}
    pull_failed = {"state": {"waiting": {"reason": "ImagePullBackOff"}}, "restartCount": 0}
    ended = {"finishedAt": "2026-12-02T12:00:00Z", "exitCode": 137, "reason": "Error"}
    restarted = {"state": {"running": {}}, "ready": True, "restartCount": 2,
                 "lastState": {"terminated": ended}}  # fmt: skip
    exited = {"state": {"terminated": {"exitCode": 3}}, "restartCount": 0}
    assert _cells(pod("Pending", pulling), "Pod")["Status"] == "ContainerCreating"
    assert _cells(pod("Pending", pull_failed), "Pod")["Status"] == "ImagePullBackOff"
    assert _cells(pod("Failed", exited), "Pod")["Status"] == "ExitCode:3"
    cells = _cells(pod("Running", restarted), "Pod")
    assert cells["Status"] == "Running" and cells["Ready"] == "1/1"
    assert cells["Restarts"].startswith("2 (") and cells["Restarts"].endswith(" ago)")
    going = pod("Running", restarted, deletionTimestamp="2026-12-02T12:00:00Z")
    assert _cells(going, "Pod")["Status"] == "Terminating"

    svc = {"metadata": {**meta, "name": "job-a0-rdzv"},
           "spec": {"clusterIP": "None", "selector": {"job": "j", "rank": "0"},
                    "ports": [{"port": 29500, "protocol": "TCP"}]}}  # fmt: skip
    cells = _cells(svc, "Service")
    assert (cells["Type"], cells["Cluster-IP"], cells["Port(s)"]) == ("ClusterIP", "None",
                                                                      "29500/TCP")  # fmt: skip
    assert cells["Selector"] == "job=j,rank=0"


def test_the_registry_holds_the_images_of_the_examples_and_the_chart() -> None:
    from omni_operator.sandbox.cluster import DEFAULT_IMAGES
    from omni_operator.sandbox.kubelet.images import Registry, image_ref

    from ...conftest import REPO

    registry = Registry.of(DEFAULT_IMAGES)
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "OmniTrainingJob":  # spec.image or its default
                image = doc["spec"].get("image", OmniTrainingJobSpec.model_fields["image"].default)
                assert registry.has(image), path
    chart = REPO / "charts" / "megascale-omni"
    values = yaml.safe_load((chart / "values.yaml").read_text())["image"]
    version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    assert registry.has(f"{values['repository']}:{values['tag'] or version}")
    assert image_ref("busybox") == "docker.io/library/busybox:latest"
    assert image_ref("localhost:5000/a/b") == "localhost:5000/a/b:latest"
    assert image_ref("ghcr.io/x/y@sha256:ab") == "ghcr.io/x/y@sha256:ab"
    assert not registry.has("ghcr.io/megascale-omni/trainer:0.0.9")


def test_crash_back_off_as_a_kubelet_counts_it() -> None:
    """The first crash restarts at once; each later one waits the delay (from its end), which
    doubles up to 30x the first (10 s .. 5 min on a kubelet); a crash more than twice the cap
    after the last restart starts over."""
    entry, waits, now = None, [], 0.0
    for _ in range(8):  # a container crashing 5 s after each restart
        wait, entry = crash_backoff(entry, now, first_s=10.0)
        waits.append(wait)
        now += wait + 5.0
    assert waits == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
    wait, entry = crash_backoff(entry, now + 601.0, first_s=10.0)  # ran 10 min fine
    assert (wait, entry.delay) == (0.0, 10.0)
    assert crash_backoff(entry, now + 605.0, first_s=10.0)[0] == 10.0


def test_event_times_are_stored_as_the_api_server_stores_them() -> None:
    """kopf posts ``+00:00`` with microseconds; the API server keeps RFC 3339 ``Z`` times, which
    ``kubectl get events --sort-by=.lastTimestamp`` orders."""
    from omni_operator.sandbox.emulator.writes import api_times

    posted = "2026-12-06T15:13:21.123456+00:00"
    event = {"firstTimestamp": posted, "lastTimestamp": "2026-12-06T16:13:21+01:00",
             "eventTime": posted, "message": posted}  # fmt: skip
    assert api_times(event) == {
        "firstTimestamp": "2026-12-06T15:13:21Z",
        "lastTimestamp": "2026-12-06T15:13:21Z",
        "eventTime": "2026-12-06T15:13:21.123456Z",
        "message": posted,
    }
