"""Failed attempts the in-pod supervisors report over HTTP (``omni_trainer.failure_report``).

An in-place pod's container outlives its trainer's failure: the supervisor turns the pod
unready and serves the failure on its ``supervisor`` port. The operator reads it from every
pod whose trainer container runs unready, on each reconcile (the readiness change itself wakes
the job), and counts it as the container's termination would (``recovery.with_reports``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from omni_trainer.failure_report import FAILURE_PATH, REPORT_PORT

Obj = dict[str, Any]


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


class SupervisorReports:
    """The default report source: each unready in-place pod's ``/failure``, read concurrently."""

    def __init__(self, *, port: int = REPORT_PORT, timeout_s: float = 2.0) -> None:
        self.port = port
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __call__(self, pods: list[Obj]) -> dict[str, Obj]:
        asking = {
            p["metadata"]["name"]: url
            for p in pods
            if (url := reporting(p, port=self.port)) is not None
        }
        if not asking:
            return {}
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            docs = await asyncio.gather(*(_read(session, url) for url in asking.values()))
        return {name: doc for name, doc in zip(asking, docs, strict=True) if doc is not None}


async def _read(session: aiohttp.ClientSession, url: str) -> Obj | None:
    try:
        async with session.get(url + FAILURE_PATH) as resp:
            if resp.status != 200:
                return None  # 404: healthy, or still starting
            doc = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None  # not up (yet): no news is no failure; a dead pod reports otherwise
    ok = isinstance(doc, dict) and isinstance(doc.get("exitCode"), int)
    return doc if ok else None
