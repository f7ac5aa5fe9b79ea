"""The operator in-process against the API emulator, driven by code: what tests and benches share.

:class:`Cluster` wraps an :class:`~omni_operator.sandbox.emulator.Emulator` served over HTTP and
acts as the user (applies jobs), the kubelets and node controller (writes pod phases, container
states and Node conditions through the API) and the trainer (its progress), and starts the real
kopf operator in a task (cancelling it is instant). Pods do not run. Time is a :class:`Clock`
the caller moves forward, so grace periods and hang timeouts elapse without sleeping.
:func:`job_manifest` is the small valid job they apply (``examples/tiny-cpu.yaml`` of the source
tree on 2 nodes x 2 GPUs). Used by ``tests/operator`` and ``bench/operator_scale.py``; the
``omni sandbox`` cluster (:mod:`.cluster`) runs real pods instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf
import yaml

from omni_operator.crd import crd
from omni_operator.reconcile import Progress
from omni_operator.render import ANNOTATION_NODE, LABEL_ATTEMPT, LABEL_JOB
from omni_operator.sandbox.cluster import SPINE, ZONE, node_object
from omni_operator.sandbox.emulator import Emulator
from omni_operator.spec import GROUP, PLURAL, VERSION

NS = "ml"
"""The namespace the jobs are applied in."""
JOBS = f"{GROUP}/{VERSION}/{PLURAL}"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
"""The source tree's examples (tests and benches run from a checkout)."""


def job_manifest(name: str = "train", **spec: Any) -> dict[str, Any]:
    """examples/tiny-cpu.yaml on 2 nodes x 2 GPUs, reorder groups of 2 inside one spine;
    ``spec`` overrides its keys (a dict value is merged one level deep)."""
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"].update(
        nodes=2,
        gpusPerNode=2,
        topology={"networkDomainLabels": [ZONE, SPINE], "reorderGroupSize": 2},
        restartPolicy={"backoffSeconds": {"base": 0, "max": 0}, "nodeLostGraceSeconds": 30},
    )
    doc["spec"]["trainer"]["data"]["microBatchSize"] = 2
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return doc


class Clock:
    """Real time plus an offset the caller advances."""

    def __init__(self) -> None:
        self.offset = dt.timedelta()

    def __call__(self) -> dt.datetime:
        return dt.datetime.now(tz=dt.UTC) + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += dt.timedelta(seconds=seconds)

    def iso(self, seconds_ago: float = 0) -> str:
        t = self() - dt.timedelta(seconds=seconds_ago)
        return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def gpu_node(name: str, spine: str, *, clock: Clock) -> dict[str, Any]:
    """8 GPUs in zone z1, Ready for an hour (of ``clock``)."""
    node = node_object(name, gpus=8, spine=spine, zone="z1", cpu=96)
    (ready,) = node["status"]["conditions"]
    ready["lastTransitionTime"] = clock.iso(3600)
    return node


class Cluster:
    """The emulator plus helpers that act as users, kubelets and the trainer."""

    def __init__(self, emu: Emulator, url: str, session: aiohttp.ClientSession) -> None:
        self._memos: list[kopf.Memo] = []
        self.emu = emu
        self.url = url
        self.http = session
        self.clock = Clock()
        self.progress: dict[str, Progress] = {}
        self._operator: asyncio.Task[None] | None = None

    # -- API calls as a user would make them ----------------------------------------------------
    async def call(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        hdrs = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.http.request(
            method, self.url + path, json=body, headers={**hdrs, **headers}
        ) as resp:
            data = await resp.json(content_type=None)
            assert resp.status < 400, (resp.status, data)
            return data

    async def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        return await self.call("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", doc)

    async def patch_job(self, name: str, body: dict[str, Any]) -> None:
        await self.call("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}", body)

    async def delete_job(self, name: str) -> None:
        await self.call("DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}")

    # -- kubelet / node controller -----------------------------------------------------------
    async def set_pod(self, name: str, status: dict[str, Any]) -> None:
        await self.call("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}/status", {"status": status})

    async def run_pod(self, pod: dict[str, Any]) -> None:
        """Bind the pod to the node it was placed on and mark it Running."""
        name = pod["metadata"]["name"]
        node = pod["metadata"]["annotations"][ANNOTATION_NODE]
        await self.call(
            "PATCH", f"/api/v1/namespaces/{NS}/pods/{name}", {"spec": {"nodeName": node}}
        )
        await self.set_pod(name, {"phase": "Running"})

    async def run_pods(self, job: str, attempt: int | None = None, *, at_once: int = 1) -> None:
        """:meth:`run_pod` for every pod of the job (of ``attempt``), ``at_once`` at a time."""
        limit = asyncio.Semaphore(at_once)

        async def one(pod: dict[str, Any]) -> None:
            async with limit:
                await self.run_pod(pod)

        await asyncio.gather(*(one(p) for p in self.pods(job, attempt)))

    async def exit_pod(self, name: str, code: int, *, reason: str = "Error") -> None:
        phase = "Succeeded" if code == 0 else "Failed"
        term = {"exitCode": code, "reason": reason, "finishedAt": self.clock.iso()}
        await self.set_pod(
            name,
            {
                "phase": phase,
                "containerStatuses": [{"name": "trainer", "state": {"terminated": term}}],
            },
        )

    async def crash_trainer(self, name: str, code: int = 1) -> None:
        """The trainer container ended with ``code`` and the kubelet restarted it in the pod
        (``restartPolicy: OnFailure``): the pod runs on, the end is in ``lastState``."""
        term = {"exitCode": code, "reason": "Error", "finishedAt": self.clock.iso()}
        status = {
            "name": "trainer",
            "ready": False,
            "restartCount": 1,
            "state": {"running": {"startedAt": self.clock.iso()}},
            "lastState": {"terminated": term},
        }
        await self.set_pod(name, {"phase": "Running", "containerStatuses": [status]})

    async def node_not_ready(self, name: str, *, seconds_ago: float = 0) -> None:
        await self._node_ready_condition(name, "Unknown", "NodeStatusUnknown", seconds_ago)

    async def node_ready(self, name: str) -> None:
        """The node is back: Ready since now (the cluster's clock)."""
        await self._node_ready_condition(name, "True", "KubeletReady", 0)

    async def _node_ready_condition(
        self, name: str, status: str, reason: str, seconds_ago: float
    ) -> None:
        condition = {"type": "Ready", "status": status, "reason": reason,
                     "lastTransitionTime": self.clock.iso(seconds_ago)}  # fmt: skip
        await self.call("PATCH", f"/api/v1/nodes/{name}", {"status": {"conditions": [condition]}})

    # -- reads --------------------------------------------------------------------------------
    def job(self, name: str) -> dict[str, Any]:
        obj = self.emu.stored(JOBS, NS, name)
        assert obj is not None, f"job {name} is gone"
        return obj

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def pods(self, job: str, attempt: int | None = None) -> list[dict[str, Any]]:
        return [
            p
            for p in self.emu.stored_all("v1/pods", NS)
            if p["metadata"]["labels"].get(LABEL_JOB) == job
            and (attempt is None or p["metadata"]["labels"][LABEL_ATTEMPT] == str(attempt))
        ]

    def events(self, job: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.emu.stored_all("v1/events", NS)
            if e["involvedObject"].get("name") == job and e["involvedObject"].get("kind") != "Pod"
        ]

    async def wait(self, what: str, predicate: Callable[[], Any], timeout: float = 10) -> Any:
        """Poll until ``predicate()`` is truthy; fail naming ``what`` and the job states."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                jobs = {j["metadata"]["name"]: j.get("status") for j in self.emu.stored_all(JOBS)}
                raise AssertionError(f"timed out waiting for {what}; jobs: {yaml.safe_dump(jobs)}")
            await asyncio.sleep(0.05)

    # -- the operator -------------------------------------------------------------------------
    def kube_rules_used(self) -> set[tuple[str, str, str]]:
        """RBAC rules the operator's API client needed, over every operator started here."""
        return {r for m in self._memos if "omni" in m for r in m["omni"].kube.used}

    async def start_operator(self, **settings: Any) -> None:
        """Start the operator in-process; ``settings`` go into kopf's memo (``resync_seconds``,
        ``metrics``: see ``omni_operator.handlers.state``)."""
        import omni_operator.handlers  # noqa: F401  (registers the operator's handlers)

        assert self._operator is None
        memo = kopf.Memo(
            api_server=self.url, clock=self.clock, progress_source=self._progress, **settings
        )
        self._memos.append(memo)
        self._operator = asyncio.create_task(
            kopf.operator(
                registry=kopf.get_default_registry(),
                standalone=True,
                clusterwide=True,
                memo=memo,
            )
        )

    async def stop_operator(self) -> None:
        task, self._operator = self._operator, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _progress(self, job: Any, pods: Any) -> Progress | None:
        return self.progress.get(job.metadata.name)


@contextlib.asynccontextmanager
async def running_cluster(
    spines: Sequence[str], *, emulator: Emulator | None = None, **settings: Any
) -> AsyncIterator[Cluster]:
    """An emulator on 127.0.0.1 with the CRD, the namespace and one :func:`gpu_node` per entry
    of ``spines`` (``n0``, ``n1``...: the spine each is in), and the operator running
    (``settings``: see :meth:`Cluster.start_operator`)."""
    emu = Emulator() if emulator is None else emulator  # an empty emulator is falsy
    async with emu, kmock.Server(emu) as server:
        emu.declare(JOBS, kind="OmniTrainingJob", namespaced=True, status=True)
        url = str(server.url).rstrip("/")
        async with aiohttp.ClientSession() as session:
            c = Cluster(emu, url, session)
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
            await c.call("POST", "/api/v1/namespaces", namespace)
            await c.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd())
            for i, spine in enumerate(spines):
                await c.call("POST", "/api/v1/nodes", gpu_node(f"n{i}", spine, clock=c.clock))
            await c.start_operator(**settings)
            try:
                yield c
            finally:
                await c.stop_operator()
