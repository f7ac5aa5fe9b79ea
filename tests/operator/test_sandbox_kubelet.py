"""The sandbox's kubelet simulator against the emulator: it schedules pods onto their node, runs
their command as processes, reports exits, and injects faults (kill, hang, node lost)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import psutil
import pytest
import pytest_asyncio

from omni_operator.sandbox import control
from omni_operator.sandbox.cluster import node_object
from omni_operator.sandbox.control import FAULT
from omni_operator.sandbox.emulator import Emulator
from omni_operator.sandbox.kubelet import Kubelet
from omni_operator.sandbox.kubelet.container import pod_processes
from omni_operator.sandbox.kubelet.node import SimNode

pytestmark = pytest.mark.asyncio
NS = "default"


async def inject_fault(url: str, fault: str, target: str, *, namespace: str) -> str:
    """``omni sandbox fault``'s request, off this event loop (the emulator answers on it)."""
    return await asyncio.to_thread(control.inject_fault, url, fault, target, namespace=namespace)


class Env:
    def __init__(self, emu: Emulator, url: str, http: aiohttp.ClientSession, kubelet: Kubelet):
        self.emu, self.url, self.http, self.kubelet = emu, url, http, kubelet

    async def post(self, path: str, body: dict[str, Any]) -> None:
        async with self.http.post(self.url + path, json=body) as resp:
            assert resp.status < 400, await resp.text()

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.http.patch(self.url + path, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()

    async def delete(self, path: str) -> None:
        async with self.http.delete(self.url + path) as resp:
            assert resp.status < 400, await resp.text()

    def pod(self, name: str) -> dict[str, Any]:
        obj = self.emu.stored("v1/pods", NS, name)
        assert obj is not None
        return obj

    async def wait(self, what: str, check: Callable[[], Any], timeout: float = 20) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while not (value := check()):
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)
        return value


def _pod(name: str, node: str, script: str, *, gpus: int = 0) -> dict[str, Any]:
    """A pod pinned like the operator pins them, running a Python one-liner and a child."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
            "terminationGracePeriodSeconds": 1,
            "restartPolicy": "Never",
            "containers": [{
                "name": "trainer",
                "command": [sys.executable, "-c", script],
                "env": [{"name": "WHO", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {},
            }],
        },
    }  # fmt: skip


# The pod's first process starts a child (like torchrun's workers) and both sleep.
SLEEPER = (
    "import os, subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print('hello from', os.environ['WHO'], flush=True); time.sleep(120)"
)


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    emulator = Emulator(graceful_pods=True)
    async with emulator as emu, kmock.Server(emu) as server, aiohttp.ClientSession() as http:
        url = str(server.url).rstrip("/")
        nodes = [SimNode("node-0", 0, 1), SimNode("node-1", 1, 1)]
        kubelet = Kubelet(api=url, nodes=nodes, workdir=tmp_path, cwd=tmp_path, tick_s=0.05)
        emu.pod_logs = kubelet.pod_log
        e = Env(emu, url, http, kubelet)
        for n in nodes:
            await e.post("/api/v1/nodes", node_object(n.name, gpus=n.gpus, spine="s"))
        task = asyncio.create_task(kubelet.run())
        try:
            yield e
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _phase(e: Env, name: str) -> str | None:
    return (e.pod(name).get("status") or {}).get("phase")


def _exit_code(e: Env, name: str) -> int | None:
    (cs,) = e.pod(name)["status"].get("containerStatuses") or [{}]
    return ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")


async def test_runs_reports_and_kills_a_pod_with_all_its_processes(env: Env) -> None:
    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("a", "node-1", SLEEPER))
    await env.wait("Running", lambda: _phase(env, "a") == "Running")
    pod = env.pod("a")
    assert pod["spec"]["nodeName"] == "node-1" and pod["status"]["podIP"].startswith(
        f"127.{env.kubelet.net.subnet}.2."
    )
    await env.wait("both processes", lambda: len(pod_processes(pod["metadata"]["uid"])) == 2)
    await env.wait("the log", lambda: "hello from a" in (env.kubelet.pod_log(NS, "a") or ""))

    await inject_fault(env.url, "kill-pod", "a", namespace=NS)
    await env.wait("Failed", lambda: _phase(env, "a") == "Failed")
    assert _exit_code(env, "a") == 137  # SIGKILL, as a container runtime reports it
    assert FAULT not in (env.pod("a")["metadata"].get("annotations") or {})  # acted on once
    await env.wait("no process left", lambda: not pod_processes(pod["metadata"]["uid"]))


async def test_exit_codes_and_gpu_accounting(env: Env) -> None:
    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("ok", "node-0", "print(1)", gpus=1))
    await env.wait("Succeeded", lambda: _phase(env, "ok") == "Succeeded")
    assert _exit_code(env, "ok") == 0
    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("bad", "node-0", "raise SystemExit(3)"))
    await env.wait("Failed", lambda: _phase(env, "bad") == "Failed")
    assert _exit_code(env, "bad") == 3

    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("big", "node-0", SLEEPER, gpus=2))
    await env.wait("Unschedulable", lambda: env.pod("big").get("status", {}).get("conditions"))
    await asyncio.sleep(0.3)  # node-0 has 1 GPU: never scheduled
    cond = env.pod("big")["status"]["conditions"][0]
    assert "nodeName" not in env.pod("big")["spec"]
    assert cond["reason"] == "Unschedulable" and "1 of 2 nvidia.com/gpu free" in cond["message"]
    await env.delete(f"/api/v1/namespaces/{NS}/pods/big")


async def test_bound_pods_hold_their_gpus_and_cpu_until_they_end(env: Env) -> None:
    """Two 1-GPU pods created together for node-1 (1 GPU): one binds, the other waits until
    the first ends; a pod asking more CPU than the node has left never binds."""
    cpus = os.cpu_count() or 1
    for name in ("g1", "g2"):
        await env.post(f"/api/v1/namespaces/{NS}/pods", _pod(name, "node-1", SLEEPER, gpus=1))

    def bound() -> list[str]:
        pods = [env.emu.stored("v1/pods", NS, n) for n in ("g1", "g2")]
        return [p["metadata"]["name"] for p in pods if p and p["spec"].get("nodeName")]

    await env.wait("one bound", lambda: len(bound()) == 1 and len(env.kubelet.containers) == 1)
    await asyncio.sleep(0.3)
    (first,) = bound()
    other = "g2" if first == "g1" else "g1"
    cond = env.pod(other)["status"]["conditions"][0]
    assert cond["reason"] == "Unschedulable" and "0 of 1 nvidia.com/gpu free" in cond["message"]
    cpu = _pod("cpu", "node-1", "print(1)")
    cpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": f"{cpus * 1000 + 1}m"}}
    await env.post(f"/api/v1/namespaces/{NS}/pods", cpu)
    await env.wait("cpu unschedulable", lambda: env.pod("cpu").get("status", {}).get("conditions"))
    assert "cpu free" in env.pod("cpu")["status"]["conditions"][0]["message"]
    await env.delete(f"/api/v1/namespaces/{NS}/pods/{first}")
    await env.wait("the other bound", lambda: bound() == [other], timeout=20)


async def test_hang_stops_the_processes_and_deletion_ends_them(env: Env) -> None:
    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("h", "node-0", SLEEPER))
    await env.wait("Running", lambda: _phase(env, "h") == "Running")
    uid = env.pod("h")["metadata"]["uid"]
    await env.wait("both processes", lambda: len(pod_processes(uid)) == 2)
    await inject_fault(env.url, "hang-pod", "h", namespace=NS)
    first = env.kubelet.containers[f"{NS}/h"].proc.pid

    def states() -> dict[bool, set[str]]:
        out: dict[bool, set[str]] = {}
        for p in pod_processes(uid):
            out.setdefault(p.pid == first, set()).add(p.status())
        return out

    # The trainer hangs; the container's init (the supervisor, or torchrun) does not.
    await env.wait("stopped", lambda: states().get(False) == {psutil.STATUS_STOPPED})
    assert psutil.STATUS_STOPPED not in states()[True]
    assert _phase(env, "h") == "Running"  # a hang is silent: the API still says Running
    await env.delete(f"/api/v1/namespaces/{NS}/pods/h")
    await env.wait("no process left", lambda: not pod_processes(uid))


async def test_throttle_slows_the_trainer_on_a_duty_cycle_until_removed(
    env: Env, tmp_path: Path
) -> None:
    """The child ticks every 10 ms into a file: throttled, it ticks about half as often; the
    pod's first process is never stopped; unthrottled, it runs at full speed again."""
    ticks = tmp_path / "ticks"
    child = (
        f"import time\nwhile True:\n    open({str(ticks)!r}, 'a').write('.')\n    time.sleep(0.01)"
    )
    # the child starts after the throttle (as torchrun's workers do): the cycle finds it
    script = (f"import subprocess, sys, time; time.sleep(1); "
              f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)")  # fmt: skip
    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("t", "node-0", script))
    await env.wait("Running", lambda: f"{NS}/t" in env.kubelet.containers)
    uid = env.pod("t")["metadata"]["uid"]
    first = env.kubelet.containers[f"{NS}/t"].proc.pid
    await inject_fault(env.url, "throttle-pod", "t", namespace=NS)
    await env.wait("ticking", lambda: ticks.exists() and ticks.stat().st_size > 10)

    async def rate(seconds: float = 2.0) -> float:
        before = ticks.stat().st_size
        await asyncio.sleep(seconds)
        return (ticks.stat().st_size - before) / seconds

    await env.wait("throttled", lambda: env.kubelet.containers[f"{NS}/t"].throttle is not None)
    await asyncio.sleep(1.0)  # the cycle has read the process list again
    stopped_seen = set()
    for _ in range(20):
        for p in pod_processes(uid):
            stopped_seen.add((p.pid == first, p.status() == psutil.STATUS_STOPPED))
        await asyncio.sleep(0.05)
    assert (False, True) in stopped_seen and (True, True) not in stopped_seen
    slow = await rate()
    await inject_fault(env.url, "unthrottle-pod", "t", namespace=NS)
    await env.wait("unthrottled", lambda: env.kubelet.containers[f"{NS}/t"].throttle is None)
    full = await rate()
    assert slow < 0.7 * full, (slow, full)
    assert FAULT not in (env.pod("t")["metadata"].get("annotations") or {})
    await env.delete(f"/api/v1/namespaces/{NS}/pods/t")
    await env.wait("no process left", lambda: not pod_processes(uid))


async def test_node_lost_kills_its_pods_silently_and_marks_it_unknown(env: Env) -> None:
    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("p", "node-0", SLEEPER))
    await env.wait("Running", lambda: _phase(env, "p") == "Running")
    uid = env.pod("p")["metadata"]["uid"]
    await inject_fault(env.url, "node-lost", "node-0", namespace=NS)

    def ready() -> str:
        node = env.emu.stored("v1/nodes", None, "node-0") or {}
        (cond,) = node["status"]["conditions"]
        return cond["status"]

    await env.wait("Ready=Unknown", lambda: ready() == "Unknown")
    await env.wait("no process left", lambda: not pod_processes(uid))
    await asyncio.sleep(0.3)
    assert _phase(env, "p") == "Running"  # nobody reports for a lost node's pods
    await inject_fault(env.url, "node-ready", "node-0", namespace=NS)
    await env.wait("Ready again", lambda: ready() == "True")
    with pytest.raises(RuntimeError, match="pod 'nope' not found in namespace default"):
        await inject_fault(env.url, "kill-pod", "nope", namespace=NS)


def _message(e: Env, name: str) -> str | None:
    (cs,) = e.pod(name)["status"].get("containerStatuses") or [{}]
    return ((cs.get("state") or {}).get("terminated") or {}).get("message")


async def test_termination_messages_as_a_kubelet_reports_them(env: Env) -> None:
    """The file (OMNI_TERMINATION_LOG stands for terminationMessagePath) wins; with
    FallbackToLogsOnError an empty file on failure gives the log's tail; else no message."""
    writes = (
        "import os; open(os.environ['OMNI_TERMINATION_LOG'], 'w').write('ValueError: the cause'); "
        "print('noise', flush=True); raise SystemExit(1)"
    )
    prints = "print('\\n'.join(f'line {i}' for i in range(100)), flush=True); raise SystemExit(2)"
    pods = {"file": writes, "tail": prints, "plain": prints, "ok": "print('done')"}
    for name, script in pods.items():
        pod = _pod(name, "node-0", script)
        if name != "plain":
            pod["spec"]["containers"][0]["terminationMessagePolicy"] = "FallbackToLogsOnError"
        await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
    for name in pods:
        await env.wait(f"{name} ended", lambda n=name: _phase(env, n) in ("Succeeded", "Failed"))
    assert _message(env, "file") == "ValueError: the cause"
    tail = _message(env, "tail")
    assert tail is not None and tail.splitlines() == [f"line {i}" for i in range(20, 100)]
    assert _message(env, "plain") is None and _message(env, "ok") is None


async def test_a_running_pod_without_processes_is_reported_lost(env: Env) -> None:
    """After a sandbox restart the API still says Running, but no process exists: reported as
    a kubelet reports a container whose state it lost (the operator then restarts the job)."""
    pod = _pod("orphan", "node-1", SLEEPER)
    pod["spec"]["nodeName"] = "node-1"
    pod["status"] = {"phase": "Running", "podIP": "127.9.2.1"}  # what the previous run wrote
    await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
    await env.wait("Failed", lambda: _phase(env, "orphan") == "Failed")
    (cs,) = env.pod("orphan")["status"]["containerStatuses"]
    term = cs["state"]["terminated"]
    assert term["exitCode"] == 137 and term["reason"] == "ContainerStatusUnknown"
    assert "previous kubelet" in term["message"] and not env.kubelet.containers


async def test_images_outside_the_registry_fail_to_pull_like_a_kubelet(env: Env) -> None:
    """ErrImagePull at each attempt, ImagePullBackOff in between, the pod stays Pending and its
    processes never start; an image the registry holds runs (``busybox`` means docker.io's)."""
    from omni_operator.sandbox.kubelet.images import Registry

    env.kubelet.images.registry = Registry.of(["busybox", "ghcr.io/megascale-omni/trainer:0.1.0"])
    bad, good = _pod("bad", "node-0", SLEEPER), _pod("good", "node-1", SLEEPER)
    bad["spec"]["containers"][0]["image"] = "ghcr.io/megascale-omni/trainer:0.0.9"
    good["spec"]["containers"][0]["image"] = "docker.io/library/busybox:latest"
    await env.post(f"/api/v1/namespaces/{NS}/pods", bad)
    await env.post(f"/api/v1/namespaces/{NS}/pods", good)

    def waiting() -> dict[str, Any]:
        (cs,) = env.pod("bad").get("status", {}).get("containerStatuses") or [{}]
        return (cs.get("state") or {}).get("waiting") or {}

    seen: list[str] = []
    deadline = asyncio.get_running_loop().time() + 10
    while len(set(seen)) < 2 or seen[-1] != "ErrImagePull" or seen.count("ErrImagePull") < 2:
        reason = waiting().get("reason")
        if reason and (not seen or seen[-1] != reason):
            seen.append(reason)
        assert asyncio.get_running_loop().time() < deadline, seen
        await asyncio.sleep(0.02)
    assert seen[:3] == ["ErrImagePull", "ImagePullBackOff", "ErrImagePull"]
    assert "ghcr.io/megascale-omni/trainer:0.0.9: not found" in waiting()["message"]
    assert _phase(env, "bad") == "Pending" and env.pod("bad")["spec"]["nodeName"] == "node-0"
    assert not pod_processes(env.pod("bad")["metadata"]["uid"])
    await env.wait("good Running", lambda: _phase(env, "good") == "Running")
    await env.delete(f"/api/v1/namespaces/{NS}/pods/bad")
    await env.wait("pull forgotten", lambda: not env.kubelet.images.pulls)


async def test_a_node_pulls_an_image_once_and_keeps_it(env: Env) -> None:
    """With a pull time, a node's first pod waits in ContainerCreating for it (a second pod of
    that node shares the pull), the node keeps the image: a later pod there and a restarted
    container start at once, a pod on another node pulls again."""
    from omni_operator.sandbox.kubelet.images import Registry

    pull_s = 1.5
    env.kubelet.images.registry = Registry.of(["busybox"], pull_s=pull_s)
    loop = asyncio.get_running_loop()

    async def started(name: str, node: str) -> float:
        """Seconds from creating the pod (restarted on failure) to its Running phase."""
        t0 = loop.time()
        pod = _pod(name, node, SLEEPER)
        pod["spec"]["restartPolicy"] = "OnFailure"
        pod["spec"]["containers"][0]["image"] = "busybox"
        await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
        await env.wait(f"{name} Running", lambda: _phase(env, name) == "Running")
        return loop.time() - t0

    def waiting(name: str) -> dict[str, Any]:
        pod = env.emu.stored("v1/pods", NS, name) or {}
        (cs,) = pod.get("status", {}).get("containerStatuses") or [{}]
        return (cs.get("state") or {}).get("waiting") or {}

    first = asyncio.ensure_future(started("first", "node-0"))
    await env.wait("pulling", lambda: waiting("first").get("reason") == "ContainerCreating")
    assert 'Pulling image "busybox"' in waiting("first")["message"]
    assert _phase(env, "first") == "Pending" and not env.kubelet.containers
    await asyncio.sleep(pull_s / 2)
    second = await started("second", "node-0")  # created while node-0 pulls: it waits the rest
    assert await first >= pull_s and second < pull_s, (second, pull_s)
    assert await started("third", "node-0") < pull_s  # node-0 keeps the image
    assert await started("other", "node-1") >= pull_s  # node-1 pulls it for itself

    def restarted() -> dict[str, Any] | None:
        (cs,) = env.pod("other")["status"].get("containerStatuses") or [{}]
        return cs if cs.get("restartCount") == 1 and "running" in cs.get("state", {}) else None

    t0 = loop.time()
    await inject_fault(env.url, "kill-pod", "other", namespace=NS)  # restarted in its pod
    await env.wait("other restarted", restarted)
    assert loop.time() - t0 < pull_s  # nothing to pull


# SIGTERM: finish the "step", write a file, exit 143 (what the trainer's graceful stop does).
GRACEFUL = (
    "import pathlib, signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), "
    "pathlib.Path('saved').write_text('ok'), sys.exit(143))); "
    "print('up', flush=True); time.sleep(120)"
)


async def test_a_deleted_pod_gets_its_grace_then_the_kubelet_removes_it(env: Env) -> None:
    """Deletion marks the pod; its process gets SIGTERM and finishes within the grace (the
    pod object stays meanwhile, as on a cluster); then the kubelet completes the deletion.
    A forced deletion (grace 0) removes a pod at once."""
    pod = _pod("g", "node-0", GRACEFUL)
    pod["spec"]["terminationGracePeriodSeconds"] = 30
    await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
    await env.wait("up", lambda: "up" in (env.kubelet.pod_log(NS, "g") or ""))
    await env.delete(f"/api/v1/namespaces/{NS}/pods/g")
    meta = env.pod("g")["metadata"]
    assert meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 30
    await asyncio.sleep(0.3)
    assert env.emu.stored("v1/pods", NS, "g") is not None  # still stopping
    await env.wait("removed", lambda: env.emu.stored("v1/pods", NS, "g") is None, timeout=10)
    assert (env.kubelet.cwd / "saved").read_text() == "ok"

    await env.post(f"/api/v1/namespaces/{NS}/pods", _pod("f", "node-1", SLEEPER))
    await env.wait("Running", lambda: _phase(env, "f") == "Running")
    uid = env.pod("f")["metadata"]["uid"]
    async with env.http.delete(env.url + f"/api/v1/namespaces/{NS}/pods/f",
                               json={"gracePeriodSeconds": 0}) as resp:  # fmt: skip
        assert resp.status == 200
    assert env.emu.stored("v1/pods", NS, "f") is None
    await env.wait("no process left", lambda: not pod_processes(uid))


async def test_a_container_restarts_in_its_pod_under_its_restart_policy(env: Env) -> None:
    """``OnFailure``: a container that dies (``kill-pod``: every process) or whose first
    process exits non-zero after a ``crash`` (its other processes killed) is restarted in the
    same pod, UID and address, with ``restartCount`` up and its end in ``lastState``; success
    ends it."""
    await env.post(f"/api/v1/namespaces/{NS}/configmaps",
                   {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                    "data": {"order": "1"}})  # fmt: skip
    # The init waits for its child, then exits 0 once the ConfigMap says "done", else 1.
    script = (
        "import os, subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "while c.poll() is None:\n"
        "    if open(os.environ['ORDER']).read() == 'done': sys.exit(0)\n"
        "    time.sleep(0.05)\n"
        "sys.exit(1)\n"
    )
    pod = _pod("r", "node-0", script)
    pod["spec"]["restartPolicy"] = "OnFailure"
    pod["spec"]["volumes"] = [{"name": "cfg", "configMap": {"name": "cfg"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "cfg", "mountPath": "/etc/cfg"}]
    pod["spec"]["containers"][0]["env"].append({"name": "ORDER", "value": "/etc/cfg/order"})
    await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
    await env.wait("Running", lambda: _phase(env, "r") == "Running")
    first = env.pod("r")
    uid, ip = first["metadata"]["uid"], first["status"]["podIP"]
    await env.wait("two processes", lambda: len(pod_processes(uid)) == 2)

    def restarted(n: int) -> dict[str, Any] | None:
        (cs,) = env.pod("r")["status"].get("containerStatuses") or [{}]
        return cs if cs.get("restartCount") == n and "running" in cs.get("state", {}) else None

    await inject_fault(env.url, "crash-pod", "r", namespace=NS)  # the child dies: init exits 1
    cs = await env.wait("restart 1", lambda: restarted(1))
    assert cs["lastState"]["terminated"]["exitCode"] == 1
    await env.wait("two processes", lambda: len(pod_processes(uid)) == 2)
    await inject_fault(env.url, "kill-pod", "r", namespace=NS)  # the whole container
    cs = await env.wait("restart 2", lambda: restarted(2))
    assert cs["lastState"]["terminated"]["exitCode"] == 137
    now = env.pod("r")
    assert (now["metadata"]["uid"], now["status"]["podIP"], _phase(env, "r")) == (
        uid, ip, "Running")  # fmt: skip

    await env.patch(f"/api/v1/namespaces/{NS}/configmaps/cfg", {"data": {"order": "done"}})
    await env.patch(f"/api/v1/namespaces/{NS}/pods/r", {"metadata": {"annotations": {"a": "b"}}})
    await env.wait("Succeeded", lambda: _phase(env, "r") == "Succeeded")  # the pod synced
    assert env.pod("r")["status"]["containerStatuses"][0]["restartCount"] == 2


async def test_projected_volumes_follow_their_sources_when_the_kubelet_syncs_the_pod(
    env: Env,
) -> None:
    """A kubelet rewrites a running pod's ConfigMap and downwardAPI volumes when it syncs the
    pod: a ConfigMap update alone waits for the periodic sync (``syncFrequency``), an update of
    the pod (an annotation) is a sync at once, for both volumes."""
    env.kubelet.volumes.sync_s = 3600.0  # no periodic sync during the first part
    await env.post(f"/api/v1/namespaces/{NS}/configmaps",
                   {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"},
                    "data": {"k": "1"}})  # fmt: skip
    pod = _pod("p", "node-0", SLEEPER)
    pod["metadata"]["annotations"] = {"x/order": "1"}
    path = "metadata.annotations['x/order']"
    pod["spec"]["volumes"] = [
        {"name": "c", "configMap": {"name": "c"}},
        {"name": "d", "downwardAPI": {"items": [
            {"path": "order", "fieldRef": {"fieldPath": path}},
            {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
    ]  # fmt: skip
    await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
    await env.wait("Running", lambda: _phase(env, "p") == "Running")
    volumes = env.kubelet.workdir / "pods" / NS / "p" / "volumes"

    def files() -> tuple[str, str, str]:
        return tuple((volumes / f).read_text() for f in ("c/k", "d/order", "d/name"))

    assert files() == ("1", "1", "p")
    await env.patch(f"/api/v1/namespaces/{NS}/configmaps/c", {"data": {"k": "2"}})
    await asyncio.sleep(0.5)  # ten ticks: a kubelet does not sync a pod for its ConfigMap
    assert files() == ("1", "1", "p")
    await env.patch(f"/api/v1/namespaces/{NS}/pods/p",
                    {"metadata": {"annotations": {"x/order": "2"}}})  # fmt: skip
    await env.wait("the pod synced", lambda: files() == ("2", "2", "p"))
    await env.patch(f"/api/v1/namespaces/{NS}/configmaps/c", {"data": {"k": "3"}})
    env.kubelet.volumes.sync_s = 0.5
    await env.wait("the periodic sync", lambda: files() == ("3", "2", "p"))


async def test_a_new_pod_of_an_old_name_starts_with_empty_empty_dirs(env: Env) -> None:
    """An emptyDir outlives container restarts but not its pod: a job deleted and created
    again (pods of the same names) must not find the old pods' files (a supervisor's state)."""
    script = (
        "import os, sys\n"
        "f = os.path.join(os.environ['STATE'], 'ran')\n"
        "print('found' if os.path.exists(f) else 'fresh', flush=True)\n"
        "open(f, 'w').write('1')\n"
    )
    pod = _pod("e", "node-0", script)
    pod["spec"]["volumes"] = [{"name": "state", "emptyDir": {}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "state", "mountPath": "/var/run/state"}
    ]
    pod["spec"]["containers"][0]["env"].append({"name": "STATE", "value": "/var/run/state"})
    for _ in range(2):
        await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
        await env.wait("Succeeded", lambda: _phase(env, "e") == "Succeeded")
        await env.delete(f"/api/v1/namespaces/{NS}/pods/e")
        await env.wait("removed", lambda: env.emu.stored("v1/pods", NS, "e") is None)
    assert (env.kubelet.pod_log(NS, "e") or "").split() == ["fresh", "fresh"]


# Serves /healthz on the pod's address: 200 until the file `sick` appears in its directory.
HEALTH = (
    "import os, http.server\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(503 if os.path.exists('sick') else 200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer((os.environ['OMNI_METRICS_ADDR'], 8080), H).serve_forever()\n"
)


def _ready(e: Env, name: str) -> bool | None:
    (cs,) = (e.pod(name).get("status") or {}).get("containerStatuses") or [{}]
    return cs.get("ready")


async def test_a_readiness_probe_sets_the_container_ready_as_a_kubelet_does(
    env: Env, tmp_path: Path
) -> None:
    """Unready from the start until the probe answers; unready again after failureThreshold
    failed probes in a row, ready after successThreshold good ones; the container runs on."""
    pod = _pod("probed", "node-0", HEALTH)
    (container,) = pod["spec"]["containers"]
    container["ports"] = [{"name": "health", "containerPort": 8080}]
    container["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "health"},
                                   "periodSeconds": 1, "failureThreshold": 2}  # fmt: skip
    await env.post(f"/api/v1/namespaces/{NS}/pods", pod)
    await env.wait("Running", lambda: _phase(env, "probed") == "Running")
    assert _ready(env, "probed") is False  # not probed yet
    await env.wait("ready", lambda: _ready(env, "probed"))
    (tmp_path / "sick").write_text("")
    t0 = asyncio.get_running_loop().time()
    await env.wait("unready", lambda: _ready(env, "probed") is False)
    assert asyncio.get_running_loop().time() - t0 >= 1.0  # two failures, a period apart
    assert _phase(env, "probed") == "Running"
    (tmp_path / "sick").unlink()
    await env.wait("ready again", lambda: _ready(env, "probed"))


async def test_a_sandbox_without_its_operator_leaves_the_jobs_to_one_run_elsewhere(
    tmp_path: Path,
) -> None:
    """``omni sandbox up --no-operator``: the API server, nodes and kubelet run, no operator
    task does (``omni operator --standalone --server URL`` is run beside it, and can be killed
    and started again as a Deployment's pod); the state file says so."""
    import json

    from omni_operator.sandbox.cluster import Sandbox, SandboxConfig
    from omni_operator.sandbox.control import STATE_FILE

    config = SandboxConfig(nodes=1, gpus_per_node=0, workdir=tmp_path, operator=False)
    async with Sandbox.start(config) as sb, aiohttp.ClientSession() as http:
        assert "sandbox-operator" not in {t.get_name() for t in sb.tasks}
        assert json.loads((tmp_path / STATE_FILE).read_text())["operator"] is False
        async with http.get(f"{sb.url}/api/v1/nodes") as resp:
            assert [n["metadata"]["name"] for n in (await resp.json())["items"]] == ["node-0"]
