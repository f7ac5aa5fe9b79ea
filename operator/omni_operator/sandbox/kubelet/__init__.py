"""The sandbox's scheduler and kubelets: pods of the API emulator run as local processes.

One :class:`Kubelet` plays every emulated node. Each tick it reads Nodes and Pods over HTTP like
the real components do, and hands each pod to the role that owns its state:

* faults (:mod:`.faults`): the fault annotations on Nodes and running Pods (a node lost, a pod
  killed, crashed, hung, throttled);
* scheduling (:mod:`.scheduler`): a pending pod is bound to a Ready node that holds its
  requests, or stays Pending with kube-scheduler's reason;
* images (:mod:`.images`): a bound pod's images are pulled (or fail to be) before it starts;
* the runtime (:mod:`.runtime`): the pod's container runs as a local process group, is
  restarted under its ``restartPolicy`` with a crash back-off (:mod:`.backoff`), probed, and
  stopped on deletion; its command and environment (:mod:`.command`), volumes (:mod:`.volumes`)
  and address (:mod:`.network`) are the pod's as the sandbox emulates them.

A pod the API reports Running on a live node for which this kubelet has no process lost it with
the previous kubelet (a sandbox restart): it is reported ended (``ContainerStatusUnknown``), as
a kubelet reports a container whose state it lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from omni_operator.sandbox.kubelet.api import ApiClient, pod_key
from omni_operator.sandbox.kubelet.backoff import CRASH_BACKOFF_S
from omni_operator.sandbox.kubelet.container import Container
from omni_operator.sandbox.kubelet.faults import Faults
from omni_operator.sandbox.kubelet.images import ImagePuller, Registry
from omni_operator.sandbox.kubelet.network import Network
from omni_operator.sandbox.kubelet.node import SimNode, find_node
from omni_operator.sandbox.kubelet.runtime import Runtime, grace_seconds
from omni_operator.sandbox.kubelet.scheduler import Scheduler
from omni_operator.sandbox.kubelet.volumes import SYNC_S, Volumes

Obj = dict[str, Any]
log = logging.getLogger("omni.sandbox")


class Kubelet:
    """Scheduler + kubelets of all emulated nodes (see the module docstring).

    Args:
        api: the API server's URL.
        nodes: the emulated nodes.
        workdir: where pods' directories, logs, claims and nodes' disks live.
        cwd: the working directory of every pod's processes.
        tick_s: how often the kubelet reads the API server.
        net: the pods' loopback network (a fresh one: an address range of its own).
        registry: images the nodes can pull (None: every image).
        crash_backoff_s: the first back-off of a crashing container.
        sync_s: a kubelet's ``syncFrequency`` (:class:`.volumes.Volumes`).
    """

    def __init__(
        self,
        *,
        api: str,
        nodes: list[SimNode],
        workdir: Path,
        cwd: Path | None = None,
        tick_s: float = 0.2,
        net: Network | None = None,
        registry: Registry | None = None,
        crash_backoff_s: float = CRASH_BACKOFF_S,
        sync_s: float = SYNC_S,
    ) -> None:
        self.api, self.nodes, self.workdir, self.tick_s = api, nodes, workdir, tick_s
        self.cwd = Path.cwd() if cwd is None else cwd
        self.net = Network() if net is None else net
        self.client = ApiClient(api)
        self.scheduler = Scheduler(self.client, nodes)
        self.images = ImagePuller(self.client, registry)
        self.volumes = Volumes(self.client, workdir, sync_s)
        self.runtime = Runtime(self.client, self.images, self.volumes, self.net, workdir,
                               self.cwd, crash_backoff_s)  # fmt: skip
        self.faults = Faults(self.client, self.runtime, self.volumes)

    @property
    def containers(self) -> dict[str, Container]:
        """The running containers, by pod (``<namespace>/<name>``)."""
        return self.runtime.containers

    def pod_log(self, namespace: str, name: str) -> str | None:
        return self.runtime.pod_log(namespace, name)

    def stop_all(self) -> None:
        self.runtime.stop_all()

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            self.client.http = http
            try:
                while True:
                    try:
                        await self.tick()
                    except aiohttp.ClientError as err:
                        log.warning(f"sandbox kubelet: API call failed: {err}")
                    await asyncio.sleep(self.tick_s)
            finally:
                self.stop_all()
                self.client.http = None

    async def tick(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in await self.client.list("/api/v1/nodes")}
        for sim in self.nodes:
            if sim.name in nodes:
                await self.faults.on_node(sim, nodes[sim.name])
        pods = await self.client.list("/api/v1/pods")
        self.scheduler.observe(pods)
        live = set()
        for pod in pods:
            live.add(pod_key(pod))
            await self._sync_pod(pod, nodes)
        for key in [k for k in self.containers if k not in live]:
            self.runtime.terminate(self.containers[key], grace_s=0)  # deleted outright
        self.images.forget(live)
        self.runtime.forget(live)
        await self.runtime.reap()

    async def _sync_pod(self, pod: Obj, nodes: Mapping[str, Obj]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        running = self.containers.get(pod_key(pod))
        if running is not None and running.uid != meta.get("uid"):  # same name, new pod
            self.runtime.terminate(running, grace_s=0)
            running = None
        if meta.get("deletionTimestamp"):
            grace = meta.get("deletionGracePeriodSeconds", grace_seconds(spec))
            if running is not None:
                self.runtime.terminate(running, grace_s=float(grace))
            elif not (find_node(self.nodes, spec.get("nodeName")) or SimNode("", 0, 0)).lost:
                await self.client.remove_pod(pod)  # nothing runs (any more): it completes
            return
        if running is None:
            await self._sync_waiting(pod, nodes)
        elif not await self.faults.on_pod(pod, running):
            await self.volumes.sync(pod, running)
            await self.runtime.probe(pod, running)

    async def _sync_waiting(self, pod: Obj, nodes: Mapping[str, Obj]) -> None:
        """A pod with no container running: restart it in place when its back-off is over,
        report one the previous kubelet ran, schedule it, or pull its images and start it."""
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            return
        sim = find_node(self.nodes, spec.get("nodeName"))
        restart = self.runtime.restarts.get(pod_key(pod))
        if restart is not None:
            if sim is not None and not sim.lost and asyncio.get_running_loop().time() >= restart.at:
                await self.runtime.start(pod, sim, restart=restart)
            return
        if status.get("phase") == "Running" and sim is not None and not sim.lost:
            (container,) = spec["containers"]
            await self.client.report_exit(pod, container["name"], 137,
                                          reason="ContainerStatusUnknown",
                                          message="the container's processes ended with the "
                                          "sandbox's previous kubelet")  # fmt: skip
            return
        if not spec.get("nodeName"):
            await self.scheduler.schedule(pod, nodes)
            return
        if sim is None or sim.lost or status.get("phase") not in (None, "", "Pending"):
            return
        if await self.images.pulled(pod, sim):
            await self.runtime.start(pod, sim)
