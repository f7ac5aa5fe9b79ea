"""Failed attempts the in-pod supervisors report over HTTP (``omni_trainer.failure_report``).

An in-place pod's container outlives its trainer's failure: the supervisor turns the pod
unready and serves the failure on its ``supervisor`` port. The operator reads it from every
pod whose trainer container runs unready, on each reconcile (the readiness change itself wakes
the job), and counts it as the container's termination would
(``recovery.failures.with_reports``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from omni_operator.render import ANNOTATION_ORDER
from omni_trainer.failure_report import FAILURE_PATH, REPORT_PORT

Obj = dict[str, Any]
KNOWN_LIMIT = 10_000


def reporting(pod: Obj, *, port: int = REPORT_PORT) -> str | None:
    """The address of the pod's supervisor when it may hold a report: its first container runs,
    is not ready, and is probed on the supervisor's port (None otherwise)."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    containers = (pod.get("spec") or {}).get("containers") or []
    if not statuses or not containers or not status.get("podIP"):
        return None
    probe = (containers[0].get("readinessProbe") or {}).get("httpGet") or {}
    probed = probe.get("port") in ("supervisor", REPORT_PORT)
    cs = statuses[0]
    if not probed or cs.get("ready") or "running" not in (cs.get("state") or {}):
        return None
    return f"http://{status['podIP']}:{port}"


def ordered(pod: Obj) -> int | None:
    """The attempt the operator last ordered the pod to run (its order annotation)."""
    try:
        return int(json.loads(pod["metadata"]["annotations"][ANNOTATION_ORDER])["attempt"])
    except (KeyError, TypeError, ValueError):
        return None


class SupervisorReports:
    """The default report source: each unready in-place pod's ``/failure``, read concurrently.

    A report stands until the pod's next order (its supervisor then starts that attempt): it is
    read once per pod and order, not on every reconcile. After a failure every pod of a large
    job reports at once, and each of their readiness changes wakes the job."""

    def __init__(self, *, port: int = REPORT_PORT, timeout_s: float = 2.0) -> None:
        self.port = port
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._known: dict[str, Obj] = {}
        """Pod UID -> its report, while that pod's order is not newer than the report."""

    async def __call__(self, pods: list[Obj]) -> dict[str, Obj]:
        found: dict[str, Obj] = {}
        asking: dict[str, tuple[str, str]] = {}  # name -> (uid, url)
        for pod in pods:
            uid, name = pod["metadata"].get("uid", ""), pod["metadata"]["name"]
            url = reporting(pod, port=self.port)
            known = self._known.pop(uid, None)
            if url is None:
                continue  # ready again (or ended): its report, if any, is over
            if known is not None and known["attempt"] >= (ordered(pod) or 0):
                found[name] = self._known[uid] = known
            else:
                asking[name] = (uid, url)
        if asking:
            async with aiohttp.ClientSession(timeout=self.timeout) as session:
                docs = await asyncio.gather(*(_read(session, url) for _, url in asking.values()))
            for (name, (uid, _)), doc in zip(asking.items(), docs, strict=True):
                if doc is not None:
                    found[name] = self._known[uid] = doc
        while len(self._known) > KNOWN_LIMIT:  # pods deleted while unready
            del self._known[next(iter(self._known))]
        return found


async def _read(session: aiohttp.ClientSession, url: str) -> Obj | None:
    try:
        async with session.get(url + FAILURE_PATH) as resp:
            if resp.status != 200:
                return None  # 404: healthy, or still starting
            doc = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None  # not up (yet): no news is no failure; a dead pod reports otherwise
    ok = isinstance(doc, dict) and all(isinstance(doc.get(k), int) for k in ("exitCode", "attempt"))
    return doc if ok else None
