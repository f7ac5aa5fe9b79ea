"""A Kubernetes cluster on one machine for trying the operator: ``omni sandbox up``.

The kmock API emulator (:mod:`.emulator`) on 127.0.0.1 with the OmniTrainingJob CRD, N emulated
GPU nodes labelled with a zone and a spine, the kubelet simulator (:mod:`.kubelet`) that really
runs the pods, an emulation of Kueue's pod integration (:mod:`.kueue`) and of the Deployment
controller (:mod:`.deployments`), and the operator itself in the same process (or none:
``SandboxConfig.operator``, then the chart's, installed by :mod:`.chart`, or one run by hand).
A kubeconfig is written next to a state file, so real ``kubectl`` and ``omni sandbox fault``
find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf
import yaml
from aiohttp.web_protocol import RequestHandler

from omni_operator.sandbox import kueue
from omni_operator.sandbox.control import STATE_FILE
from omni_operator.sandbox.deployments import DeploymentController
from omni_operator.sandbox.emulator import Emulator
from omni_operator.sandbox.kubelet import Kubelet
from omni_operator.sandbox.kubelet.backoff import CRASH_BACKOFF_S
from omni_operator.sandbox.kubelet.images import ImageConfig, Registry
from omni_operator.sandbox.kubelet.node import GPU, SimNode, ready_condition
from omni_operator.sandbox.kubelet.volumes import SYNC_S
from omni_operator.sandbox.tables import printer_columns
from omni_operator.spec import DEFAULT_IMAGE, GROUP, PLURAL, VERSION

OPERATOR_IMAGE = "ghcr.io/megascale-omni/operator:0.1.0"
"""The chart's operator image (``image.repository`` at the chart's ``appVersion``)."""
OPERATOR_ENTRYPOINT = ImageConfig(
    entrypoint=("kopf", "run", "-m", "omni_operator.handlers"),
    cmd=("--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"),
)
"""``dockerfiles/operator.Dockerfile``'s ENTRYPOINT and CMD (the chart passes only args): the
kubelet runs this Python's ``kopf`` console script with them (a test keeps them in step)."""
IMAGE_CONFIGS = {OPERATOR_IMAGE: OPERATOR_ENTRYPOINT}
DEFAULT_IMAGES: tuple[str, ...] = (DEFAULT_IMAGE, OPERATOR_IMAGE)
"""What the sandbox's registry holds unless ``--image`` says otherwise: the images examples/ and
the chart use (tests keep this in step with them)."""
ZONE = "topology.kubernetes.io/zone"
SPINE = f"{GROUP}/spine"
API_STORE = "api-objects.json"
"""Every API object, persisted on each write (what etcd holds for a real API server)."""
KUBECONFIG_FILE = "kubeconfig"
log = logging.getLogger("omni.sandbox")


@dataclass(frozen=True)
class SandboxConfig:
    nodes: int = 4
    gpus_per_node: int = 8
    """Emulated ``nvidia.com/gpu`` per node (processes still run on the CPU)."""
    spines: int = 2
    """Network domains: consecutive nodes share a spine label (placement keeps groups inside)."""
    port: int = 0
    """API server port on 127.0.0.1 (0: any free port)."""
    workdir: Path = Path(".omni-sandbox")
    """State file, kubeconfig, pod volumes and logs."""
    resync_seconds: float = 2.0
    """The operator's longest pause between reconciles (progress polling)."""
    images: tuple[str, ...] = DEFAULT_IMAGES
    """The images its nodes can pull; pods naming any other fail with ErrImagePull."""
    pull_seconds: float = 0.0
    """How long a node takes to pull an image it does not hold yet (0: instant)."""
    crash_backoff_seconds: float = CRASH_BACKOFF_S
    """The kubelets' first back-off of a crashing container (a real kubelet's: 10; its cap and
    reset scale with it)."""
    sync_seconds: float = SYNC_S
    """The kubelets' ``syncFrequency``: a running pod sees a ConfigMap update this late at
    worst, unless the pod itself is updated (a kubelet syncs it then)."""
    operator: bool = True
    """Run the operator in the sandbox's process; False: none runs until one is started beside
    it: the chart's Deployment (``omni sandbox install-chart``) or ``omni operator --standalone
    --server URL`` (a process that can be SIGKILLed and started again, as a Deployment's pod)."""

    def __post_init__(self) -> None:
        if (self.nodes < 1 or self.spines < 1 or self.gpus_per_node < 0 or self.pull_seconds < 0
                or self.sync_seconds <= 0 or self.crash_backoff_seconds <= 0):  # fmt: skip
            raise ValueError(
                "the sandbox needs nodes >= 1, spines >= 1, gpus-per-node >= 0, "
                "pull-seconds >= 0, sync-seconds > 0 and crash-backoff-seconds > 0"
            )


def node_object(
    name: str, *, gpus: int, spine: str, zone: str = "sandbox", cpu: int | None = None
) -> dict[str, Any]:
    """A Ready GPU node as a cluster reports it, with the topology labels placement reads."""
    capacity = {"cpu": str(cpu or os.cpu_count() or 1), "memory": "64Gi", GPU: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, ZONE: zone, SPINE: spine},
        },
        "spec": {},
        "status": {
            "allocatable": capacity,
            "capacity": capacity,
            "conditions": ready_condition(True),
        },
    }


def kubeconfig(server: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "omni-sandbox", "cluster": {"server": server}}],
        "users": [{"name": "omni-sandbox", "user": {}}],
        "contexts": [
            {
                "name": "omni-sandbox",
                "context": {"cluster": "omni-sandbox", "user": "omni-sandbox"},
            }
        ],
        "current-context": "omni-sandbox",
    }


@dataclass
class Sandbox:
    """The running sandbox (use ``async with Sandbox.start(config) as sb``)."""

    config: SandboxConfig
    url: str
    emulator: Emulator
    kubelet: Kubelet
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def kubeconfig_path(self) -> Path:
        return self.config.workdir / KUBECONFIG_FILE

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: SandboxConfig) -> AsyncIterator[Sandbox]:
        from omni_operator.crd import crd

        workdir = config.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(config, workdir=workdir)
        async with (
            Emulator(store=workdir / API_STORE, graceful_pods=True) as emu,  # kubelet deletes
            kmock.Server(emu, port=config.port or None) as server,
        ):
            restored = emu.restore()  # a restarted sandbox keeps its jobs and pods
            if restored:
                log.warning(f"sandbox: restored {restored} objects from {workdir / API_STORE}")
            definition = crd()
            names = definition["spec"]["names"]
            (served,) = definition["spec"]["versions"]
            emu.declare(f"{GROUP}/{VERSION}/{PLURAL}", kind=names["kind"], namespaced=True,
                        status=True, short_names=names.get("shortNames", ()),
                        columns=printer_columns(definition),
                        schema=served["schema"]["openAPIV3Schema"])  # fmt: skip
            url = str(server.url).rstrip("/")
            nodes = [SimNode(f"node-{i}", i, config.gpus_per_node) for i in range(config.nodes)]
            registry = Registry.of(config.images, pull_s=config.pull_seconds,
                                   configs=IMAGE_CONFIGS)  # fmt: skip
            kubelet = Kubelet(api=url, nodes=nodes, workdir=workdir, registry=registry,
                              sync_s=config.sync_seconds,
                              crash_backoff_s=config.crash_backoff_seconds)  # fmt: skip
            emu.pod_logs = kubelet.pod_log
            for key, kind, namespaced, status, short in kueue.RESOURCES:
                emu.declare(key, kind=kind, namespaced=namespaced, status=status,
                            short_names=short)  # fmt: skip
            emu.before_create = kueue.gate  # Kueue's webhook, emulated
            sb = cls(config=config, url=url, emulator=emu, kubelet=kubelet)
            async with aiohttp.ClientSession() as http:
                await _post(http, url, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                            copy.deepcopy(crd()))  # fmt: skip
                per_spine = -(-config.nodes // config.spines)
                for n in nodes:
                    spine = f"spine-{n.index // per_spine}"
                    await _post(http, url, "/api/v1/nodes",
                                node_object(n.name, gpus=n.gpus, spine=spine))  # fmt: skip
            sb.tasks.append(asyncio.create_task(kubelet.run(), name="sandbox-kubelet"))
            sb.tasks.append(asyncio.create_task(kueue.KueueEmulator(url).run(),
                                                name="sandbox-kueue"))  # fmt: skip
            sb.tasks.append(asyncio.create_task(DeploymentController(url).run(),
                                                name="sandbox-deployments"))  # fmt: skip
            if config.operator:
                memo = kopf.Memo(api_server=url, resync_seconds=config.resync_seconds)
                sb.tasks.append(asyncio.create_task(_operator(memo), name="sandbox-operator"))
            sb._write_state()
            try:
                yield sb
            finally:
                # Pods first: they must not outlive the sandbox however long the operator takes
                # to stop (a caller that kills the sandbox after a timeout would orphan them).
                kubelet.stop_all()
                for task in reversed(sb.tasks):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                kubelet.stop_all()
                (workdir / STATE_FILE).unlink(missing_ok=True)

    async def wait(self) -> None:
        """Until a part of the sandbox stops (kopf stops the operator on SIGINT/SIGTERM); its
        error, if any, is raised."""
        done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"sandbox: {task.get_name()} failed") from task.exception()

    def _write_state(self) -> None:
        workdir = self.config.workdir
        self.kubeconfig_path.write_text(yaml.safe_dump(kubeconfig(self.url), sort_keys=False))
        state = {
            "server": self.url,
            "pid": os.getpid(),
            "kubeconfig": str(self.kubeconfig_path),
            "nodes": [n.name for n in self.kubelet.nodes],
            "operator": self.config.operator,
        }
        (workdir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


class _SandboxTasks(Collection["asyncio.Task[Any]"]):
    """The tasks kopf must not count as its operator's when it stops: those that existed before
    it started, the sandbox's own (named ``sandbox-*``), and the API server's handlers of open
    connections (aiohttp's ``RequestHandler.start``, one per keep-alive or watch connection of
    the kubelet, Kueue and the Deployment controller). kopf gives each task begun after it
    started 5 s to end on its own; those never end while the sandbox runs. kopf only asks
    whether a task is in it, so iterating gives the tasks from before alone."""

    def __init__(self, before: Collection[asyncio.Task[Any]]) -> None:
        self._before = frozenset(before)

    def __contains__(self, task: object) -> bool:
        if task in self._before:
            return True
        if not isinstance(task, asyncio.Task):
            return False
        code = getattr(task.get_coro(), "cr_code", None)
        return task.get_name().startswith("sandbox-") or code is RequestHandler.start.__code__

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(self._before)

    def __len__(self) -> int:
        return len(self._before)


async def _operator(memo: kopf.Memo) -> None:
    """The operator, as ``kopf.operator`` runs it (its handlers, cluster-wide, standalone;
    SIGINT/SIGTERM stop it), but stopping at once: see :class:`_SandboxTasks`."""
    import omni_operator.handlers  # noqa: F401  (registers the operator's handlers)

    before = _SandboxTasks(asyncio.all_tasks())
    tasks = await kopf.spawn_tasks(
        registry=kopf.get_default_registry(), standalone=True, clusterwide=True, memo=memo
    )
    await kopf.run_tasks(tasks, ignored=before)


async def _post(http: aiohttp.ClientSession, url: str, path: str, body: Any) -> None:
    async with http.post(url + path, json=body) as resp:
        if resp.status >= 400 and resp.status != 409:  # 409: restored from the last run
            raise RuntimeError(f"sandbox setup: POST {path}: {resp.status} {await resp.text()}")
