"""The sandbox's scheduler and kubelets: pods of the API emulator run as local processes.

One :class:`Kubelet` plays every emulated node. Each tick it reads Nodes and Pods over HTTP
like the real components do and:

* schedules: a pending pod is bound (``spec.nodeName``) to the node its required node affinity
  or ``nodeSelector`` names, if that node is Ready and its allocatable, less the requests of
  the pods bound to it (:mod:`omni_operator.capacity`: GPUs, CPU, memory...), holds the pod's
  requests; else it stays Pending, PodScheduled=False reason Unschedulable, as kube-scheduler
  leaves it (reason SchedulingGated while it carries a scheduling gate); a pod that names no
  node (a Deployment's, a job's of ``scheduling.placement: scheduler``) goes to the least
  allocated Ready node that holds its requests and passes its node and inter-pod constraints
  (:mod:`omni_operator.sandbox.scheduling`; kube-scheduler's default scoring, simplified);
* runs: a bound pod's container command (or its image's ENTRYPOINT and CMD, for an image whose
  :class:`ImageConfig` the :class:`Registry` holds: the chart's operator) starts as a process
  group in the sandbox's working directory (a shared filesystem for every node), with the pod's
  environment (and the API server's address, plus its service account's credentials unless
  ``automountServiceAccountToken: false``: :meth:`Kubelet.in_cluster`), its ConfigMap
  volumes written to files, and its status reported through ``/status`` (Running with a pod IP,
  then Succeeded/Failed with the exit code);
* restarts: a container that ends is restarted in its pod under the pod's ``restartPolicy``
  (``Always``; ``OnFailure`` when it failed) as a kubelet does: same pod, UID and address,
  ``restartCount`` up, the end in ``lastState``, ``CrashLoopBackOff`` while a restart backs off
  (the first at once, each later one after a delay counted from its end that doubles up to a
  cap; a crash more than twice the cap after the last restart is a first again: a kubelet's
  10 s, 5 min and 10 min, scaled by ``crash_backoff_s``); ConfigMap and
  downwardAPI volumes follow their sources when the kubelet syncs the pod (a container starts,
  the pod's labels or annotations change, or ``sync_s`` passes: a kubelet's ``syncFrequency``,
  1 min), so a ConfigMap update alone reaches a running pod as late as on a cluster;
* probes: a container with an ``httpGet`` readinessProbe starts unready, and its ``ready``
  follows the probe as a kubelet's does (:mod:`omni_operator.sandbox.probes`);
* stops: a deleted pod's processes get SIGTERM, then SIGKILL after its grace period
  (``deletionGracePeriodSeconds``); once they are gone the kubelet removes the pod (a forced
  deletion), as a real one does;
* pulls: a pod's images must be in the sandbox's :class:`Registry`; any other image fails as a
  real kubelet reports it: the container waits in ``ErrImagePull`` at each pull attempt and in
  ``ImagePullBackOff`` between them (the delay doubles up to a cap), the pod stays Pending. A
  node pulls an image it does not hold yet in ``Registry.pull_s`` seconds (the container waits
  in ``ContainerCreating``; pods of one node share the pull) and keeps it, as a node's image
  cache does: a pod recreated on a fresh node pays the pull, one restarted in place does not.

Networking is emulated on the loopback: every pod gets its own address ``127.<s>.<node>.<n>``
(``s`` drawn per sandbox, so that two sandboxes on one machine never share a pod address)
(the trainer's metrics endpoint binds to it through ``OMNI_METRICS_ADDR``, so the operator scrapes
``podIP:9464`` as in a cluster), cluster names (``*.svc``) resolve to the loopback where every
listener is, and a service port (torchrun's rendezvous) maps to a free local port per service
name so that jobs never collide; ``0.0.0.0`` in a command is the pod's own address. ``torchrun``
is this Python's ``torch.distributed.run``.

Faults are requested through the API, so ``kubectl annotate`` works as well as
``omni sandbox fault``: the annotation :data:`FAULT` on a Node (``lost``: its processes are
killed, it stops reporting and turns Ready=Unknown; ``ready``: it comes back;
``degraded-network``: its pods stall in a duty cycle, :mod:`omni_operator.sandbox.degrade`,
until the annotation changes) or on a Pod
(``kill``: every process of its container gets SIGKILL, exit 137; ``crash``: its newest process,
a trainer worker, dies of SIGKILL, as a rank that crashes does (torchrun stops the others, and
the supervisor or the container's end reports it);
``hang``: SIGSTOP to every process but the first, the trainer stops making progress;
``throttle``: the same processes stopped and continued on a duty cycle, :data:`THROTTLE_STOPPED`
of every :data:`THROTTLE_PERIOD_S`, until the annotation goes: a node slower than the others,
as a thermally throttled GPU or a noisy neighbour makes one). ``kill`` and ``crash`` act once:
the kubelet removes the annotation.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yarl

from omni_operator import capacity
from omni_operator.capacity import pinned_node
from omni_operator.kube_objects import node_not_ready_since
from omni_operator.sandbox import degrade, downward, scheduling
from omni_operator.sandbox.control import FAULT
from omni_operator.sandbox.probes import ReadinessProbe
from omni_trainer.termination import ENV as TERMINATION_LOG_ENV

Obj = dict[str, Any]
POD_MARKER = "OMNI_SANDBOX_POD_UID"
"""Set in every pod process's environment: descendants inherit it, so a pod's processes are
found even after torchrun's workers lost their parent (what a container's cgroup gives)."""
GPU = "nvidia.com/gpu"
GATED_MESSAGE = "Scheduling is blocked due to non-empty scheduling gates"
"""kube-scheduler's PodScheduled message for a pod with scheduling gates."""
THROTTLE_PERIOD_S = 0.1
"""Short beside a step, so the stops land in every phase of it (a period near the step time
would stop the same phase of every step)."""
THROTTLE_STOPPED = 0.5
"""The share of each period a throttled pod's processes are stopped (a node about 2x slower)."""
log = logging.getLogger("omni.sandbox")


def now_iso() -> str:
    return dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_condition(ready: bool) -> list[Obj]:
    return [
        {
            "type": "Ready",
            "status": "True" if ready else "Unknown",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "message": "sandbox kubelet is posting ready status"
            if ready
            else "Kubelet stopped posting node status (sandbox fault: lost)",
            "lastHeartbeatTime": now_iso(),
            "lastTransitionTime": now_iso(),
        }
    ]


class Network:
    """Loopback addresses for pods; cluster DNS names (``*.svc``) resolve to the loopback, and
    each (service name, port) maps to its own free local port so that jobs never collide."""

    def __init__(self, subnet: int | None = None) -> None:
        self._next_host: dict[int, int] = {}
        self._ports: dict[tuple[str, int], int] = {}
        self.subnet = random.randint(1, 254) if subnet is None else subnet
        """Second octet of every address of this sandbox (0 is 127.0.0.1's)."""

    def pod_ip(self, node_index: int) -> str:
        n = self._next_host.get(node_index, 0) % 254 + 1
        self._next_host[node_index] = n
        return f"{self.host_ip(node_index)[:-1]}{n}"

    def host_ip(self, node_index: int) -> str:
        return f"127.{self.subnet}.{node_index + 1}.0"

    @staticmethod
    def is_cluster_name(host: str) -> bool:
        return bool(_SVC.fullmatch(host))

    def port(self, host: str, port: int) -> int:
        """The local port standing for ``host:port`` (stable per name)."""
        key = (host.removesuffix(".cluster.local"), port)
        if key not in self._ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self._ports[key] = s.getsockname()[1]
        return self._ports[key]


_SVC = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.svc(\.cluster\.local)?")


class _ConfigMissing(LookupError):
    """A Secret or ConfigMap a container's environment needs does not exist (yet)."""


def localize(text: str, mounts: Mapping[str, Path]) -> str:
    """A command-line word or env value as the sandbox runs it: mount paths -> pod directories,
    cluster DNS names -> the loopback (every service listens there)."""
    for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if text == mount or text.startswith(mount + "/") or ("=" + mount) in text:
            text = text.replace(mount, str(local), 1)
    return _SVC.sub("127.0.0.1", text)


def localize_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """Every absolute path under a mount in a file's text (the job's manifest in its ConfigMap
    volume: ``stepLog``, ``checkpoint.path`` on a claim) as the pod's directory."""
    for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        pattern = r"(?<![\w./-])" + re.escape(mount.rstrip("/")) + r"(?=[/\s\"',\]}]|$)"
        text = re.sub(pattern, str(local).replace("\\", "\\\\"), text, flags=re.M)
    return text


def _flag(words: list[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
        if w == name and i + 1 < len(words):
            return words[i + 1]
    return None


def map_service_ports(words: list[str], env: dict[str, str], net: Network) -> None:
    """torchrun's ``--master-addr/--master-port`` and ``MASTER_ADDR/MASTER_PORT`` naming a
    cluster service -> its local port (in place; before the names are localized)."""
    host, port = _flag(words, "--master-addr"), _flag(words, "--master-port")
    if host and port and Network.is_cluster_name(host):
        local = str(net.port(host, int(port)))
        for i, w in enumerate(words):
            if w == f"--master-port={port}":
                words[i] = f"--master-port={local}"
            elif w == port and i > 0 and words[i - 1] == "--master-port":
                words[i] = local
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if host and port and Network.is_cluster_name(host):
        env["MASTER_PORT"] = str(net.port(host, int(port)))


def image_ref(image: str) -> str:
    """A reference as a container runtime resolves it: ``busybox`` ->
    ``docker.io/library/busybox:latest``; a host with a dot, a port or ``localhost`` is a
    registry; no tag or digest means ``latest``."""
    first, _, rest = image.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        image = "docker.io/" + (image if rest else "library/" + image)
    last = image.rsplit("/", 1)[-1]
    return image if ("@" in last or ":" in last) else image + ":latest"


@dataclass(frozen=True)
class ImageConfig:
    """What an image runs when a container names no ``command`` (its Dockerfile's)."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()


def container_argv(container: Obj, config: ImageConfig | None) -> list[str]:
    """A container's argv as a runtime builds it: ``command`` replaces the image's
    ENTRYPOINT (and drops its CMD), ``args`` replace its CMD."""
    command, args = container.get("command"), container.get("args")
    if command:
        return [*command, *(args or [])]
    if config is None:
        return list(args or [])
    return [*config.entrypoint, *(args if args else config.cmd)]


@dataclass(frozen=True)
class Registry:
    """The images the sandbox's nodes can pull (``omni sandbox up --image``)."""

    images: frozenset[str]
    pull_s: float = 0.0
    """How long a node takes to pull one of them that it does not hold yet."""
    configs: Mapping[str, ImageConfig] = field(default_factory=dict)
    """Image reference -> its ``ENTRYPOINT`` and ``CMD``, for images a container runs without
    a ``command`` (the sandbox runs their local equivalents: the same console scripts)."""

    @classmethod
    def of(
        cls,
        images: Iterable[str],
        *,
        pull_s: float = 0.0,
        configs: Mapping[str, ImageConfig] | None = None,
    ) -> Registry:
        refs = {image_ref(i): c for i, c in (configs or {}).items()}
        return cls(frozenset(image_ref(i) for i in images), pull_s, refs)

    def config(self, image: str) -> ImageConfig | None:
        return self.configs.get(image_ref(image))

    def has(self, image: str) -> bool:
        return image_ref(image) in self.images

    def not_found(self, image: str) -> str:
        """containerd's words for a reference the registry does not hold."""
        ref = image_ref(image)
        return (
            f'rpc error: code = NotFound desc = failed to pull and unpack image "{ref}": '
            f'failed to resolve reference "{ref}": {ref}: not found'
        )


SYNC_S = 60.0
"""A kubelet's default ``syncFrequency`` (1 min)."""
CRASH_BACKOFF_S = 1.0
"""The sandbox's first back-off of a crashing container (a kubelet's is 10 s)."""
CRASH_BACKOFF_CAP = 30
"""The back-off's cap, in first back-offs (a kubelet's: 5 min = 30 x 10 s)."""
PULL_BACKOFF_S = 1.0
"""The first delay between pull attempts of a missing image (a kubelet's is 10 s)."""
PULL_BACKOFF_MAX_S = 8.0


@dataclass
class _Pull:
    """A pod whose image pulls fail: attempts so far, when the next may run, what was said."""

    failures: int = 0
    next_try: float = 0.0
    reported: str = ""


@dataclass
class _Restart:
    """A container of a running pod that ended and is restarted in place."""

    count: int
    """``restartCount`` once it runs again."""
    at: float
    """When it may start (loop time)."""
    last: Obj
    """Its end, for ``lastState.terminated``."""


def go_duration(seconds: float) -> str:
    """Whole seconds as Go prints a ``time.Duration`` (``40s``, ``1m20s``, ``5m0s``), as the
    kubelet's CrashLoopBackOff message does."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class _Backoff:
    """A container's crash back-off, as a kubelet keeps it (``flowcontrol.Backoff``)."""

    delay: float
    """How long its next restart waits after it ends (doubling up to the cap)."""
    updated: float
    """When it last restarted (loop time): a crash more than twice the cap later starts over."""


def crash_backoff(entry: _Backoff | None, now: float, *, first_s: float) -> tuple[float, _Backoff]:
    """(seconds to wait, the entry after) for a container ending at ``now``: a kubelet restarts
    the first crash at once, each later one after the current delay, which doubles up to
    ``CRASH_BACKOFF_CAP * first_s``; a crash more than twice that cap after the last restart is
    a first crash again (a container that ran 10 minutes fine). Pure."""
    cap = CRASH_BACKOFF_CAP * first_s
    if entry is None or now - entry.updated > 2 * cap:
        return 0.0, _Backoff(first_s, now)
    return entry.delay, _Backoff(min(entry.delay * 2, cap), now + entry.delay)


@dataclass
class SimNode:
    name: str
    index: int
    gpus: int
    lost: bool = False
    degraded: asyncio.Task | None = None
    """The ``degraded-network`` fault's duty cycle on its pods (``sandbox.degrade``)."""
    pulled: dict[str, float] = field(default_factory=dict)
    """Its image cache: image reference -> the loop time its pull ends (started on first use)."""


@dataclass
class Container:
    """A pod's running process group."""

    pod: str  # "<namespace>/<name>"
    uid: str
    node: str
    name: str  # the container's, as the pod spec names it
    proc: subprocess.Popen[bytes]
    log_path: Path
    grace_s: float
    hung: bool = False
    throttle: asyncio.Task[None] | None = None
    """The duty cycle of a ``throttle`` fault (None: not throttled)."""
    lost: bool = False
    """Its node was lost: it is killed and nobody reports its end."""
    killing_since: float | None = None
    termination_log: Path | None = None
    """The file standing for its ``terminationMessagePath`` (``OMNI_TERMINATION_LOG``)."""
    message_policy: str = "File"
    """``terminationMessagePolicy``: ``FallbackToLogsOnError`` reports the log's tail when the
    file is empty and the container failed."""
    restart_policy: str = "Never"
    restarts: int = 0
    """``restartCount`` of the container this process group runs."""
    mounts: dict[str, Path] = field(default_factory=dict)
    synced_at: float = 0.0
    """When the kubelet last synced its pod's projected volumes (loop time)."""
    synced_meta: str = ""
    """The pod's labels and annotations then (:func:`downward.metadata_version`)."""
    readiness: ReadinessProbe | None = None


@dataclass
class Kubelet:
    """Scheduler + kubelets of all emulated nodes (see the module docstring)."""

    api: str
    nodes: list[SimNode]
    workdir: Path
    cwd: Path = field(default_factory=Path.cwd)
    tick_s: float = 0.2
    net: Network = field(default_factory=Network)
    containers: dict[str, Container] = field(default_factory=dict)
    registry: Registry | None = None
    """Images the nodes can pull; None: every image."""
    crash_backoff_s: float = CRASH_BACKOFF_S
    """The first back-off of a crashing container (:func:`crash_backoff`)."""
    sync_s: float = SYNC_S
    """A kubelet's ``syncFrequency``: how often a running pod's ConfigMap and downwardAPI
    volumes are refreshed when nothing else makes the kubelet sync it."""
    _http: aiohttp.ClientSession | None = None
    _unschedulable: dict[str, str] = field(default_factory=dict)
    """Pending pods' PodScheduled reason as last reported (Unschedulable, SchedulingGated)."""
    _held: dict[str, capacity.Resources] = field(default_factory=dict)
    """What the pods bound to each node request (this tick's bindings included)."""
    _bound: list[Obj] = field(default_factory=list)
    """The pods bound to a node (this tick's bindings included): inter-pod constraints."""
    _pulls: dict[str, _Pull] = field(default_factory=dict)
    _restarts: dict[str, _Restart] = field(default_factory=dict)
    _backoffs: dict[str, _Backoff] = field(default_factory=dict)

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            self._http = http
            try:
                while True:
                    try:
                        await self.tick()
                    except aiohttp.ClientError as err:
                        log.warning(f"sandbox kubelet: API call failed: {err}")
                    await asyncio.sleep(self.tick_s)
            finally:
                self.stop_all()
                self._http = None

    async def tick(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in await self._list("/api/v1/nodes")}
        for sim in self.nodes:
            if sim.name in nodes:
                await self._node_faults(sim, nodes[sim.name])
        pods = await self._list("/api/v1/pods")
        self._bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
        self._held = capacity.used(self._bound)
        live = set()
        for pod in pods:
            key = _key(pod)
            live.add(key)
            await self._sync_pod(pod, nodes)
        for key in [k for k in self.containers if k not in live]:
            self._terminate(self.containers[key], grace_s=0)  # deleted outright
        for table in (self._pulls, self._restarts, self._backoffs):
            for key in [k for k in table if k not in live]:
                del table[key]
        await self._reap()

    # -- nodes ---------------------------------------------------------------------------------
    async def _node_faults(self, sim: SimNode, node: Obj) -> None:
        fault = ((node["metadata"].get("annotations") or {}).get(FAULT) or "").strip()
        if (fault == "degraded-network") != (sim.degraded is not None):
            self._degrade(sim, on=fault == "degraded-network")
        if fault == "lost" and not sim.lost:
            sim.lost = True
            for c in list(self.containers.values()):
                if c.node == sim.name:
                    _signal(c, signal.SIGKILL)
                    c.lost = True
            await self._patch(
                f"/api/v1/nodes/{sim.name}", {"status": {"conditions": ready_condition(False)}}
            )
            shutil.rmtree(self.node_disk(sim.name), ignore_errors=True)  # a new node's is empty
            log.warning(f"sandbox: node {sim.name} lost (its processes and local disk)")
        elif fault in ("", "ready") and sim.lost:
            sim.lost = False
            await self._patch(
                f"/api/v1/nodes/{sim.name}", {"status": {"conditions": ready_condition(True)}}
            )
            log.warning(f"sandbox: node {sim.name} is back")

    def node_disk(self, node: str) -> Path:
        """A node's local disk (its hostPath volumes live here; gone when the node is lost)."""
        return self.workdir / "nodes" / node

    def _degrade(self, sim: SimNode, *, on: bool) -> None:
        """Start or end the node's ``degraded-network`` duty cycle (its pods' processes but
        each container's init; a hung container stays stopped)."""
        if not on:
            assert sim.degraded is not None
            sim.degraded.cancel()
            sim.degraded = None
            log.warning(f"sandbox: node {sim.name}'s network is healthy again")
            return

        def processes() -> list[psutil.Process]:
            mine = [c for c in self.containers.values() if c.node == sim.name and not c.hung]
            return [p for c in mine for p in pod_processes(c.uid) if p.pid != c.proc.pid]

        sim.degraded = asyncio.get_running_loop().create_task(degrade.throttle(processes))
        log.warning(f"sandbox: node {sim.name}'s network degraded (its pods stall in a duty cycle)")

    # -- pods ----------------------------------------------------------------------------------
    async def _sync_pod(self, pod: Obj, nodes: Mapping[str, Obj]) -> None:
        key = _key(pod)
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        running = self.containers.get(key)
        if running is not None and running.uid != meta.get("uid"):  # same name, new pod
            self._terminate(running, grace_s=0)
            running = None
        if meta.get("deletionTimestamp"):
            grace = meta.get("deletionGracePeriodSeconds", _grace(spec))
            if running is not None:
                self._terminate(running, grace_s=float(grace))
            elif not (self._sim(spec.get("nodeName")) or SimNode("", 0, 0)).lost:
                await self._remove(pod)  # nothing runs (any more): the deletion completes
            return
        if running is not None:
            fault = ((meta.get("annotations") or {}).get(FAULT) or "").strip()
            if fault in ("kill", "crash"):
                if fault == "kill":
                    _signal(running, signal.SIGKILL)
                else:
                    _crash(running)
                await self._patch(_pod_path(pod), {"metadata": {"annotations": {FAULT: None}}})
            elif fault == "hang" and not running.hung:
                running.hung = True
                _signal(running, signal.SIGSTOP, spare_first=True)
            else:
                _throttle(running, on=fault == "throttle")
                await self._sync_volumes(pod, running)
                await self._probe(pod, running)
            return
        if status.get("phase") in ("Succeeded", "Failed"):
            return
        sim = self._sim(spec.get("nodeName"))
        restart = self._restarts.get(key)
        if restart is not None:
            if sim is not None and not sim.lost and asyncio.get_running_loop().time() >= restart.at:
                await self._start(pod, sim, restart=restart)
            return
        if status.get("phase") == "Running" and sim is not None and not sim.lost:
            # The API says it runs, yet this kubelet has no process for it: they died with the
            # previous kubelet (a sandbox restart). Report it, as a kubelet reports a container
            # whose state it lost; the operator restarts the job from its checkpoint.
            (container,) = spec["containers"]
            await self._report_exit(pod, container["name"], 137, reason="ContainerStatusUnknown",
                                    message="the container's processes ended with the sandbox's "
                                    "previous kubelet")  # fmt: skip
            return
        node_name = spec.get("nodeName")
        if not node_name:
            await self._schedule(pod, nodes)
            return
        sim = self._sim(node_name)
        if sim is None or sim.lost or status.get("phase") not in (None, "", "Pending"):
            return
        if await self._pulled(pod, sim):
            await self._start(pod, sim)

    async def _pulled(self, pod: Obj, sim: SimNode) -> bool:
        """Whether the pod's images are on its node; else report the pull under way, or the
        failed pull or its back-off."""
        key = _key(pod)
        containers = pod["spec"].get("containers") or []
        missing = [
            c for c in containers if self.registry and not self.registry.has(c.get("image", ""))
        ]
        if not missing:
            cached = await self._cached(pod, sim, containers)
            if cached:
                self._pulls.pop(key, None)
            return cached
        assert self.registry is not None
        (c, *_) = missing
        pull = self._pulls.setdefault(key, _Pull())
        now = asyncio.get_running_loop().time()
        error = self.registry.not_found(c["image"])
        if now >= pull.next_try:  # a pull attempt: it fails
            pull.failures += 1
            delay = min(PULL_BACKOFF_S * 2 ** (pull.failures - 1), PULL_BACKOFF_MAX_S)
            pull.next_try = now + delay
            reason, message = "ErrImagePull", error
        else:
            reason, message = "ImagePullBackOff", f'Back-off pulling image "{c["image"]}": {error}'
        if pull.reported != f"{reason}/{pull.failures}":
            pull.reported = f"{reason}/{pull.failures}"
            await self._report_waiting(pod, c, reason, message)
            if pull.failures == 1 and reason == "ErrImagePull":
                log.warning(f"sandbox: {key}: image {c['image']} is not in the registry")
        return False

    async def _cached(self, pod: Obj, sim: SimNode, containers: list[Obj]) -> bool:
        """Whether the node holds the pod's images; the first pod that needs one starts its
        pull (``Registry.pull_s``), every pod of the node waits in ``ContainerCreating``."""
        if self.registry is None or self.registry.pull_s <= 0:
            return True
        now = asyncio.get_running_loop().time()
        pulling = []
        for c in containers:
            ref = image_ref(c.get("image", ""))
            if now < sim.pulled.setdefault(ref, now + self.registry.pull_s):
                pulling.append(c)
        if not pulling:
            return True
        key, (c, *_) = _key(pod), pulling
        pull = self._pulls.setdefault(key, _Pull())
        if pull.reported != "Pulling":
            pull.reported = "Pulling"
            message = f'Pulling image "{c["image"]}" on {sim.name}'
            await self._report_waiting(pod, c, "ContainerCreating", message)
        return False

    async def _report_waiting(self, pod: Obj, container: Obj, reason: str, message: str) -> None:
        """A Pending pod's container waiting before its first start (pulls)."""
        waiting = {"waiting": {"reason": reason, "message": message}}
        await self._patch(
            _pod_path(pod, "status"),
            {"status": {"phase": "Pending",
                        "containerStatuses": [{"name": container["name"],
                                               "image": container.get("image", ""), "ready": False,
                                               "restartCount": 0, "state": waiting}]}},
        )  # fmt: skip

    def _free(self, node: Obj) -> capacity.Resources:
        """The node's allocatable less what the pods bound to it request."""
        (left,) = capacity.free([node], []).values()
        for k, v in self._held.get(node["metadata"]["name"], {}).items():
            left[k] = left.get(k, 0.0) - v
        return left

    def _pick(self, pod: Obj, nodes: Mapping[str, Obj]) -> str | None:
        """A node for a pod that names none: among the Ready nodes that pass its constraints
        (:func:`omni_operator.sandbox.scheduling.feasible`), the one least allocated
        (kube-scheduler's default scoring), the first by name on a tie."""
        now = dt.datetime.now(tz=dt.UTC)
        labels = scheduling.labels_by_node(nodes.values())
        fits = []
        for sim in self.nodes:
            node = nodes.get(sim.name)
            if node is None or sim.lost:
                continue
            free = self._free(node)
            if not scheduling.feasible(pod, node, pods=self._bound, free=free, labels=labels,
                                       now=now):  # fmt: skip
                continue
            held = self._held.get(sim.name, {})
            alloc = capacity.resources((node.get("status") or {}).get("allocatable") or {})
            used = sum(held.get(k, 0.0) / alloc[k] for k in ("cpu", "memory") if alloc.get(k))
            fits.append((used, sim.index, sim.name))
        return min(fits)[2] if fits else None

    async def _schedule(self, pod: Obj, nodes: Mapping[str, Obj]) -> None:
        key = _key(pod)
        name = pinned_node(pod) or self._pick(pod, nodes)
        sim = self._sim(name) if name else None
        why = None
        want = capacity.pod_requests(pod)
        reason = "Unschedulable"
        if (pod.get("spec") or {}).get("schedulingGates"):
            reason, why = "SchedulingGated", GATED_MESSAGE
        elif sim is None:
            why = (
                f"node {name!r} is not a sandbox node"
                if name
                else f"0/{len(self.nodes)} nodes are available: none is Ready with room for "
                "the pod's requests and the labels of its nodeSelector"
            )
        elif (
            sim.lost
            or name not in nodes
            or node_not_ready_since(nodes[name], dt.datetime.now(tz=dt.UTC)) is not None
        ):
            why = f"node {name} is not Ready"
        else:
            short = capacity.shortfall(want, self._free(nodes[name]))
            why = f"node {name}: insufficient resources ({short})" if short else None
        if why is not None:
            if self._unschedulable.get(key) != reason:
                self._unschedulable[key] = reason
                cond = {"type": "PodScheduled", "status": "False", "reason": reason,
                        "message": why, "lastTransitionTime": now_iso()}  # fmt: skip
                await self._patch(_pod_path(pod, "status"), {"status": {"phase": "Pending",
                                  "conditions": [cond]}})  # fmt: skip
            return
        self._unschedulable.pop(key, None)
        held = self._held.setdefault(sim.name, {})  # later pods of this tick see this one
        for k, v in want.items():
            held[k] = held.get(k, 0.0) + v
        await self._patch(_pod_path(pod), {"spec": {"nodeName": name}})
        self._bound.append({**pod, "spec": {**(pod.get("spec") or {}), "nodeName": name}})

    async def _start(self, pod: Obj, sim: SimNode, *, restart: _Restart | None = None) -> None:
        """Start the pod's container (again, in the same pod and address, for ``restart``)."""
        meta, spec = pod["metadata"], pod["spec"]
        key = _key(pod)
        root = self.workdir / "pods" / meta["namespace"] / meta["name"]
        ip = (pod.get("status") or {}).get("podIP") if restart else None
        ip = ip or self.net.pod_ip(sim.index)
        try:
            (container,) = spec["containers"]
            from_refs = await self._env_from(pod, container)
        except _ConfigMissing as err:  # a kubelet waits (and retries) until the object exists
            await self._wait_config(pod, container, str(err))
            return
        if restart is None:  # a new pod (a kubelet's pod directory is per UID): its emptyDirs
            shutil.rmtree(root / "volumes", ignore_errors=True)  # start empty, even if an
            # earlier pod of the same name (a job deleted and created again) left files there
        loop_now = asyncio.get_running_loop().time()
        try:
            mounts = await self._volumes(pod, root)
            argv, env = self._command(
                pod, container, mounts, ip=ip, node=sim.name, env_from=from_refs
            )
            readiness = ReadinessProbe.of(container, ip, started_at=loop_now)
        except (ValueError, KeyError) as err:
            first = (spec.get("containers") or [{}])[0].get("name", "")
            await self._report_exit(
                pod, first, 128, reason="CreateContainerError", message=str(err)
            )
            return
        log_path = self.workdir / "logs" / meta["namespace"] / f"{meta['name']}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        termination_log = root / "termination-log"
        root.mkdir(parents=True, exist_ok=True)
        termination_log.write_bytes(b"")  # what the runtime mounts at terminationMessagePath
        env[TERMINATION_LOG_ENV] = str(termination_log)
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        count = restart.count if restart else 0
        self.containers[key] = Container(
            key, meta["uid"], sim.name, container["name"], proc, log_path, _grace(spec),
            termination_log=termination_log,
            message_policy=container.get("terminationMessagePolicy", "File"),
            restart_policy=spec.get("restartPolicy", "Always"), restarts=count, mounts=mounts,
            synced_at=loop_now, synced_meta=downward.metadata_version(meta), readiness=readiness,
        )  # fmt: skip
        self._restarts.pop(key, None)
        cs: Obj = {"name": container["name"], "ready": readiness is None, "restartCount": count,
                   "state": {"running": {"startedAt": now_iso()}}}  # fmt: skip
        if restart:
            cs["lastState"] = {"terminated": restart.last}
        body: Obj = {"phase": "Running", "podIP": ip, "hostIP": self.net.host_ip(sim.index),
                     "containerStatuses": [cs]}  # fmt: skip
        if not restart:
            body["startTime"] = now_iso()
        await self._patch(_pod_path(pod, "status"), {"status": body})
        again = f" (restart {count})" if restart else ""
        log.info(f"sandbox: {key} started{again} on {sim.name} ({ip}), log {log_path}")

    async def _config_data(self, namespace: str, kind: str, name: str) -> dict[str, bytes]:
        """A ConfigMap's or Secret's keys (Secrets base64-decoded), as the kubelet reads them.

        Raises:
            _ConfigMissing: worded as a kubelet words it (``secret "x" not found``).
        """
        plural = "secrets" if kind == "secret" else "configmaps"
        obj = await self._get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        if obj is None:
            raise _ConfigMissing(f'{kind} "{name}" not found')
        if kind == "secret":
            out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            out.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
            return out
        return {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}

    async def _env_from(self, pod: Obj, container: Obj) -> dict[str, str]:
        """``envFrom``: every key of the named Secrets and ConfigMaps, with its prefix."""
        env: dict[str, str] = {}
        for ref in container.get("envFrom") or []:
            kind = "secret" if "secretRef" in ref else "configmap"
            name = (ref.get("secretRef") or ref.get("configMapRef") or {})["name"]
            data = await self._config_data(pod["metadata"]["namespace"], kind, name)
            env.update({ref.get("prefix", "") + k: v.decode() for k, v in data.items()})
        return env

    async def _wait_config(self, pod: Obj, container: Obj, message: str) -> None:
        waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
        await self._patch(
            _pod_path(pod, "status"),
            {"status": {"phase": "Pending",
                        "containerStatuses": [{"name": container["name"],
                                               "image": container.get("image"), "ready": False,
                                               "restartCount": 0, "state": waiting}]}},
        )  # fmt: skip

    async def _volumes(self, pod: Obj, root: Path) -> dict[str, Path]:
        """ConfigMap, Secret and downwardAPI volumes as files, emptyDirs as directories, a
        PersistentVolumeClaim as one directory every pod shares (the sandbox's storage), a
        hostPath as a directory of the pod's node (:meth:`node_disk`); ``/dev/shm`` stays the
        host's."""
        meta, spec = pod["metadata"], pod["spec"]
        dirs: dict[str, Path] = {}
        for vol in spec.get("volumes") or []:
            path = root / "volumes" / vol["name"]
            if "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]["claimName"]
                path = self.workdir / "claims" / meta["namespace"] / claim
            if "hostPath" in vol:  # the node's own disk: it goes when the node is lost
                host = vol["hostPath"]["path"].lstrip("/")
                path = self.node_disk(spec["nodeName"]) / host
            path.mkdir(parents=True, exist_ok=True)
            if "downwardAPI" in vol:
                for file, content in downward.downward_files(vol["downwardAPI"], meta).items():
                    (path / file).write_bytes(content)
            for kind in ("configMap", "secret"):
                if kind in vol:
                    name = vol[kind].get("name") or vol[kind].get("secretName")
                    try:
                        data = await self._config_data(meta["namespace"], kind.lower(), name)
                    except _ConfigMissing as err:
                        raise ValueError(str(err)) from None
                    for file, content in data.items():
                        (path / file).write_bytes(content)
            dirs[vol["name"]] = path
        mounts: dict[str, Path] = {}
        if automount(pod):  # the projected service account volume a kubelet mounts
            mounts[SERVICE_ACCOUNT_DIR] = root / "volumes" / "kube-api-access"
            mounts[SERVICE_ACCOUNT_DIR].mkdir(parents=True, exist_ok=True)
        for c in spec["containers"]:
            for m in c.get("volumeMounts") or []:
                if m["mountPath"] != "/dev/shm":
                    mounts[m["mountPath"]] = dirs[m["name"]] / m.get("subPath", "")
                    mounts[m["mountPath"]].mkdir(parents=True, exist_ok=True)
        for vol in spec.get("volumes") or []:
            if "configMap" in vol:  # what the trainer reads: its paths on this pod's mounts
                for file in dirs[vol["name"]].iterdir():
                    file.write_text(localize_paths(file.read_text(), mounts))
        return mounts

    def _command(
        self,
        pod: Obj,
        container: Obj,
        mounts: Mapping[str, Path],
        *,
        ip: str,
        node: str,
        env_from: Mapping[str, str],
    ) -> tuple[list[str], dict[str, str]]:
        """argv and environment: the sandbox's own, then ``envFrom``, then ``env`` (which wins,
        as on a kubelet)."""
        config = self.registry.config(container.get("image", "")) if self.registry else None
        words = container_argv(container, config)
        if not words:
            raise ValueError(
                "the sandbox runs only containers with a command (or an image whose "
                "entrypoint it knows)"
            )
        fields = {"metadata.name": pod["metadata"]["name"],
                  "metadata.namespace": pod["metadata"]["namespace"],
                  "spec.nodeName": node, "status.podIP": ip}  # fmt: skip
        pod_env: dict[str, str] = dict(env_from)
        for item in container.get("env") or []:
            if "value" in item:
                pod_env[item["name"]] = str(item["value"])
            elif "fieldRef" in (item.get("valueFrom") or {}):
                pod_env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
        map_service_ports(words, pod_env, self.net)
        words = [own_address(localize(w, mounts), ip) for w in words]
        # torchrun, also as the command a supervisor runs (after its `--`): this Python's
        words = [x for w in words
                 for x in ([sys.executable, "-m", "torch.distributed.run"] if w == "torchrun"
                           else [w])]  # fmt: skip
        if not os.path.isabs(words[0]):
            local = Path(sys.executable).parent / words[0]
            words[0] = str(local) if local.exists() else words[0]
        env = {**os.environ, **self.in_cluster(pod, mounts)}
        env.update({k: localize(v, mounts) for k, v in pod_env.items()})
        if not automount(pod):
            env.pop("KUBECONFIG", None)  # no credentials at all, as in such a pod
        env[POD_MARKER] = pod["metadata"]["uid"]
        env["OMNI_METRICS_ADDR"] = ip
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # The sandbox's nodes share this machine's cores: OpenMP threads spinning between
        # parallel regions (libgomp's default) would take them from the other nodes' trainers.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return words, env

    def in_cluster(self, pod: Obj, mounts: Mapping[str, Path]) -> dict[str, str]:
        """The API server as a pod sees it: ``KUBERNETES_SERVICE_HOST`` / ``_PORT`` (every
        pod), and unless ``automountServiceAccountToken: false`` the service account's files
        (``token``, ``namespace``) in :data:`SERVICE_ACCOUNT_DIR`'s pod directory. A local
        process cannot open that fixed path (kopf's and client-go's in-cluster login do), so
        the same credentials are handed over as ``KUBECONFIG`` too (the API server is plain
        HTTP on the loopback, and does not check tokens)."""
        url = yarl.URL(self.api)
        env = {"KUBERNETES_SERVICE_HOST": str(url.host), "KUBERNETES_SERVICE_PORT": str(url.port),
               "KUBERNETES_PORT": f"tcp://{url.host}:{url.port}"}  # fmt: skip
        local = mounts.get(SERVICE_ACCOUNT_DIR)
        if local is None:
            return env
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        token = f"sandbox:{meta['namespace']}:{account}"
        (local / "token").write_text(token)
        (local / "namespace").write_text(meta["namespace"])
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
                  "clusters": [{"name": "in-cluster", "cluster": {"server": self.api}}],
                  "users": [{"name": account, "user": {"token": token}}],
                  "contexts": [{"name": "in-cluster", "context": {
                      "cluster": "in-cluster", "user": account,
                      "namespace": meta["namespace"]}}]}  # fmt: skip
        (local.parent / "kubeconfig").write_text(json.dumps(config))
        return {**env, "KUBECONFIG": str(local.parent / "kubeconfig")}

    async def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        for key, c in list(self.containers.items()):
            if c.killing_since is not None and loop.time() - c.killing_since > c.grace_s:
                _signal(c, signal.SIGKILL)
            code = c.proc.poll()
            if code is None:
                continue
            _throttle(c, on=False)
            _signal(c, signal.SIGKILL)  # stragglers of a pod whose first process ended
            del self.containers[key]
            if c.lost:
                continue  # a lost node is silent
            if c.killing_since is not None:  # a deleted pod stopped: the deletion completes
                ns, name = key.split("/", 1)
                await self._remove({"metadata": {"namespace": ns, "name": name}})
                continue
            exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N
            ns, name = key.split("/", 1)
            pod = {"metadata": {"namespace": ns, "name": name}}
            reason = "Completed" if exit_code == 0 else "Error"
            message = termination_message(c, exit_code)
            if c.restart_policy == "Always" or (c.restart_policy == "OnFailure" and exit_code):
                await self._back_off(pod, c, exit_code, reason=reason, message=message)
                continue
            await self._report_exit(
                pod, c.name, exit_code, reason=reason, message=message, restarts=c.restarts
            )
            log.info(f"sandbox: {key} exited with code {exit_code}")

    async def _back_off(
        self, pod: Obj, c: Container, code: int, *, reason: str, message: str | None
    ) -> None:
        """Restart the ended container in its pod, after its back-off (:func:`crash_backoff`;
        ``CrashLoopBackOff`` meanwhile)."""
        now = asyncio.get_running_loop().time()
        wait, self._backoffs[c.pod] = crash_backoff(
            self._backoffs.get(c.pod), now, first_s=self.crash_backoff_s
        )
        term: Obj = {"exitCode": code, "reason": reason, "finishedAt": now_iso()}
        if message:
            term["message"] = message
        self._restarts[c.pod] = _Restart(c.restarts + 1, now + wait, term)
        state: Obj = {"terminated": term}
        if wait > 0:
            state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": (
                        f"back-off {go_duration(wait)} restarting failed container={c.name} "
                        f"pod={c.pod}"
                    ),
                }
            }
        cs = {"name": c.name, "ready": False, "restartCount": c.restarts, "state": state,
              "lastState": {"terminated": term}}  # fmt: skip
        await self._patch(_pod_path(pod, "status"), {"status": {"containerStatuses": [cs]}})
        log.info(f"sandbox: {c.pod} exited with code {code}; restarting it in {wait:.1f} s")

    async def _sync_volumes(self, pod: Obj, c: Container) -> None:
        """A running pod's ConfigMap and downwardAPI volumes follow their sources when the
        kubelet syncs the pod: its labels or annotations changed (a pod update), or
        :attr:`sync_s` passed since the last sync (a container's start is one too,
        :meth:`_volumes`). A ConfigMap written alone can take a sync period to show."""
        now = asyncio.get_running_loop().time()
        version = downward.metadata_version(pod["metadata"])
        if version == c.synced_meta and now - c.synced_at < self.sync_s:
            return
        c.synced_at, c.synced_meta = now, version
        root = self.workdir / "pods" / c.pod
        for vol in pod["spec"].get("volumes") or []:
            if "downwardAPI" in vol:
                data = downward.downward_files(vol["downwardAPI"], pod["metadata"])
            elif "configMap" in vol:
                try:
                    data = await self._config_data(c.pod.split("/")[0], "configmap",
                                                   vol["configMap"]["name"])  # fmt: skip
                except _ConfigMissing:
                    continue
                data = {f: localize_paths(v.decode(), c.mounts).encode() for f, v in data.items()}
            else:
                continue
            for file, text in data.items():
                path = root / "volumes" / vol["name"] / file
                if not path.exists() or path.read_bytes() != text:
                    tmp = path.with_name(f".{file}.tmp")
                    tmp.write_bytes(text)
                    tmp.replace(path)  # atomic, like the kubelet's symlink swap

    async def _probe(self, pod: Obj, c: Container) -> None:
        """Run the container's readiness probe when due; its ``ready`` follows in the status."""
        probe = c.readiness
        if probe is None or self._http is None or not probe.due(asyncio.get_running_loop().time()):
            return
        if not probe.record(await probe.check(self._http)):
            return
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        if statuses:  # a merge patch replaces the list: send the container's whole status
            cs = {**statuses[0], "ready": probe.ready}
            await self._patch(_pod_path(pod, "status"), {"status": {"containerStatuses": [cs]}})
        log.info(f"sandbox: {c.pod} {'ready' if probe.ready else 'not ready'} ({probe.url})")

    async def _report_exit(
        self,
        pod: Obj,
        container: str,
        code: int,
        *,
        reason: str,
        message: str | None,
        restarts: int = 0,
    ) -> None:
        term: Obj = {"exitCode": code, "reason": reason, "finishedAt": now_iso()}
        if message:
            term["message"] = message
        await self._patch(
            _pod_path(pod, "status"),
            {"status": {"phase": "Succeeded" if code == 0 else "Failed",
                        "containerStatuses": [{"name": container, "ready": False,
                                               "restartCount": restarts,
                                               "state": {"terminated": term}}]}},
        )  # fmt: skip

    async def _remove(self, pod: Obj) -> None:
        """Finish a graceful deletion (DELETE with grace 0, as the kubelet does)."""
        assert self._http is not None
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        async with self._http.delete(self.api + _pod_path(pod), json=body) as resp:
            if resp.status not in (200, 404):
                resp.raise_for_status()

    def _terminate(self, c: Container, *, grace_s: float) -> None:
        if c.killing_since is None:
            c.killing_since = asyncio.get_running_loop().time()
            c.grace_s = grace_s
            _throttle(c, on=False)
            if c.hung:
                _signal(c, signal.SIGCONT)
            if grace_s > 0:  # like a runtime: SIGTERM to the first process, later SIGKILL all
                _signal(c, signal.SIGTERM, all_processes=False)
            else:
                _signal(c, signal.SIGKILL)

    def stop_all(self) -> None:
        for c in self.containers.values():
            _throttle(c, on=False)
            _signal(c, signal.SIGKILL)
        for c in self.containers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=5)
        self.containers.clear()

    def pod_log(self, namespace: str, name: str) -> str | None:
        path = self.workdir / "logs" / namespace / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else None

    # -- HTTP ----------------------------------------------------------------------------------
    def _sim(self, name: str | None) -> SimNode | None:
        return next((n for n in self.nodes if n.name == name), None)

    async def _list(self, path: str) -> list[Obj]:
        assert self._http is not None
        async with self._http.get(self.api + path) as resp:
            resp.raise_for_status()
            return (await resp.json()).get("items") or []

    async def _get(self, path: str) -> Obj | None:
        assert self._http is not None
        async with self._http.get(self.api + path) as resp:
            if resp.status == 404:
                return None
            resp.raise_for_status()
            return await resp.json()

    async def _patch(self, path: str, body: Obj) -> None:
        assert self._http is not None
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self._http.patch(self.api + path, json=body, headers=headers) as resp:
            if resp.status not in (200, 404):  # gone meanwhile: nothing to report to
                resp.raise_for_status()


def termination_message(c: Container, exit_code: int) -> str | None:
    """What a kubelet reports as ``state.terminated.message``: the termination file (up to 4096
    bytes), else with ``FallbackToLogsOnError`` and a failure the log's last 80 lines (up to
    2048 bytes)."""
    text = ""
    if c.termination_log is not None and c.termination_log.exists():
        text = c.termination_log.read_bytes()[:4096].decode(errors="replace").strip()
    if not text and exit_code != 0 and c.message_policy == "FallbackToLogsOnError":
        with contextlib.suppress(OSError):
            tail = c.log_path.read_bytes().splitlines()[-80:]
            text = b"\n".join(tail)[-2048:].decode(errors="replace").strip()
    return text or None


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def automount(pod: Obj) -> bool:
    """Whether the pod gets its service account's credentials (the pod's
    ``automountServiceAccountToken``, default true)."""
    return (pod.get("spec") or {}).get("automountServiceAccountToken", True) is not False


_ANY_ADDRESS = re.compile(r"(?<![\d.])0\.0\.0\.0(?![\d.])")


def own_address(word: str, ip: str) -> str:
    """``0.0.0.0`` (every address of the pod's network namespace) -> the pod's own address:
    pods share the machine's loopback here, so a listener on a fixed port (kopf's
    ``--liveness=http://0.0.0.0:8080/healthz``) binds to its pod's address only."""
    return _ANY_ADDRESS.sub(ip, word)


def _key(pod: Obj) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def _pod_path(pod: Obj, sub: str | None = None) -> str:
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
    return f"{path}/{sub}" if sub else path


def _grace(spec: Obj) -> float:
    return float(spec.get("terminationGracePeriodSeconds", 30))


def pod_processes(uid: str) -> list[psutil.Process]:
    """Every live process of the pod with this uid (by the environment marker)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(POD_MARKER) == uid:
                found.append(proc)
    return found


def _signal(
    c: Container, sig: signal.Signals, *, all_processes: bool = True, spare_first: bool = False
) -> None:
    """Signal the pod's first process, or all of them (the runtime kills the whole cgroup), or
    all but the first (``spare_first``: its init, e.g. the in-pod supervisor, lives on)."""
    procs = pod_processes(c.uid) if all_processes else []
    if spare_first:
        procs = [p for p in procs if p.pid != c.proc.pid]
    elif not all_processes or not procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(c.proc.pid, sig)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _crash(c: Container) -> None:
    """A trainer process dies: the pod's newest (a worker: torchrun, a supervisor and the
    zygote its workers fork from all started before it); the container's only one if alone."""
    started: list[tuple[float, int, psutil.Process]] = []
    for p in pod_processes(c.uid):
        with contextlib.suppress(psutil.Error):
            if p.pid != c.proc.pid:
                started.append((p.create_time(), p.pid, p))
    if not started:
        _signal(c, signal.SIGKILL, all_processes=False)
        return
    with contextlib.suppress(psutil.Error):
        max(started, key=lambda t: t[:2])[2].kill()


def _throttle(c: Container, *, on: bool) -> None:
    """Start or stop the duty cycle of a throttled pod (stopping it continues its processes)."""
    if on and c.throttle is None:
        stop_s = THROTTLE_PERIOD_S * THROTTLE_STOPPED

        def processes() -> list[psutil.Process]:  # every process but the pod's first
            return [p for p in pod_processes(c.uid) if p.pid != c.proc.pid]

        c.throttle = asyncio.get_running_loop().create_task(
            degrade.throttle(processes, stop_s=stop_s, run_s=THROTTLE_PERIOD_S - stop_s)
        )
        log.warning(f"sandbox: {c.pod} throttled ({THROTTLE_STOPPED:.0%} of the time stopped)")
    elif not on and c.throttle is not None:
        c.throttle.cancel()
        c.throttle = None
        _signal(c, signal.SIGCONT, spare_first=True)
