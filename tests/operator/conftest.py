"""The real kopf operator (``omni_operator.handlers``) against the kmock API emulator over HTTP.

Each test gets a fresh emulator on 127.0.0.1 with the CRD and four fake GPU nodes in two spines,
and an operator running in-process (``kopf.operator`` in a task; cancelling it is instant). Pods
do not run: tests write pod phases and container states through ``/status`` like a kubelet.
Time is a :class:`Clock` the test moves forward, so grace periods and hang timeouts elapse
without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import yaml

os.environ.setdefault("OMNI_RESYNC_SECONDS", "0.2")  # hang tests: progress is polled

import aiohttp
import kmock
import kopf
import pytest
import pytest_asyncio

import omni_operator.handlers  # noqa: F401  (registers the handlers)
from omni_operator.crd import crd
from omni_operator.reconcile import Progress
from omni_operator.render import LABEL_ATTEMPT, LABEL_JOB
from omni_operator.sandbox.cluster import node_object
from omni_operator.sandbox.emulator import Emulator
from omni_operator.spec import GROUP, PLURAL, VERSION

from ..jobs import NS

JOBS = f"{GROUP}/{VERSION}/{PLURAL}"


class Clock:
    """Real time plus an offset the test advances."""

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
    """8 GPUs in zone z1, Ready for an hour (of the test's clock)."""
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

    async def run_pods(self, job: str) -> None:
        for pod in self.pods(job):
            node = pod["metadata"]["annotations"][f"{GROUP}/placed-node"]
            await self.call(
                "PATCH",
                f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}",
                {"spec": {"nodeName": node}},
            )
            await self.set_pod(pod["metadata"]["name"], {"phase": "Running"})

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

    async def node_not_ready(self, name: str, *, seconds_ago: float = 0) -> None:
        await self.call(
            "PATCH",
            f"/api/v1/nodes/{name}",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "Unknown",
                            "reason": "NodeStatusUnknown",
                            "lastTransitionTime": self.clock.iso(seconds_ago),
                        }
                    ]
                }
            },
        )

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
                pytest.fail(f"timed out waiting for {what}; jobs: {yaml.safe_dump(jobs)}")
            await asyncio.sleep(0.05)

    # -- the operator -------------------------------------------------------------------------
    def kube_rules_used(self) -> set[tuple[str, str, str]]:
        """RBAC rules the operator's API client needed, over every operator started here."""
        return {r for m in self._memos if "omni" in m for r in m["omni"].kube.used}

    async def start_operator(self, **settings: Any) -> None:
        """Start the operator in-process; ``settings`` go into kopf's memo (``resync_seconds``,
        ``metrics``: see ``omni_operator.handlers.state``)."""
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


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    async with Emulator(keep_requests=True) as emu, kmock.Server(emu) as server:
        emu.declare(JOBS, kind="OmniTrainingJob", namespaced=True, status=True)
        url = str(server.url).rstrip("/")
        async with aiohttp.ClientSession() as session:
            c = Cluster(emu, url, session)
            await c.call(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            )
            await c.call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                copy.deepcopy(crd()),
            )
            for i, spine in enumerate(["a", "a", "b", "b"]):
                await c.call("POST", "/api/v1/nodes", gpu_node(f"n{i}", spine, clock=c.clock))
            await c.start_operator()
            try:
                yield c
            finally:
                await c.stop_operator()
