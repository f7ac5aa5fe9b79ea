"""The kubelet's calls to the API server: plain HTTP reads and merge patches, as the real
components make them, and the pod status reports every role writes (a container waiting, a
container that ended)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import aiohttp

Obj = dict[str, Any]


def now_iso() -> str:
    return dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_key(pod: Obj) -> str:
    """``<namespace>/<name>``: how the kubelet's tables name a pod."""
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def pod_path(pod: Obj, sub: str | None = None) -> str:
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
    return f"{path}/{sub}" if sub else path


@dataclass
class ApiClient:
    """The API server at :attr:`url`, over the session :meth:`Kubelet.run` opens."""

    url: str
    http: aiohttp.ClientSession | None = None

    async def list(self, path: str) -> list[Obj]:
        assert self.http is not None
        async with self.http.get(self.url + path) as resp:
            resp.raise_for_status()
            return (await resp.json()).get("items") or []

    async def get(self, path: str) -> Obj | None:
        assert self.http is not None
        async with self.http.get(self.url + path) as resp:
            if resp.status == 404:
                return None
            resp.raise_for_status()
            return await resp.json()

    async def patch(self, path: str, body: Obj) -> None:
        assert self.http is not None
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.http.patch(self.url + path, json=body, headers=headers) as resp:
            if resp.status not in (200, 404):  # gone meanwhile: nothing to report to
                resp.raise_for_status()

    async def remove_pod(self, pod: Obj) -> None:
        """Finish a graceful deletion (DELETE with grace 0, as the kubelet does)."""
        assert self.http is not None
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        async with self.http.delete(self.url + pod_path(pod), json=body) as resp:
            if resp.status not in (200, 404):
                resp.raise_for_status()

    async def report_waiting(
        self, pod: Obj, container: str, image: str | None, reason: str, message: str
    ) -> None:
        """A Pending pod's container waiting before its first start (a pull, a missing
        Secret or ConfigMap); ``image`` None leaves the status without one."""
        waiting = {"waiting": {"reason": reason, "message": message}}
        await self.patch(
            pod_path(pod, "status"),
            {"status": {"phase": "Pending",
                        "containerStatuses": [{"name": container, "image": image,
                                               "ready": False, "restartCount": 0,
                                               "state": waiting}]}},
        )  # fmt: skip

    async def report_exit(
        self,
        pod: Obj,
        container: str,
        code: int,
        *,
        reason: str,
        message: str | None,
        restarts: int = 0,
    ) -> None:
        """The pod's end: Succeeded on exit code 0, else Failed, with the container's."""
        term: Obj = {"exitCode": code, "reason": reason, "finishedAt": now_iso()}
        if message:
            term["message"] = message
        await self.patch(
            pod_path(pod, "status"),
            {"status": {"phase": "Succeeded" if code == 0 else "Failed",
                        "containerStatuses": [{"name": container, "ready": False,
                                               "restartCount": restarts,
                                               "state": {"terminated": term}}]}},
        )  # fmt: skip
