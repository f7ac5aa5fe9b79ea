"""Readiness probes as a kubelet runs them (``httpGet``, the kind trainer pods use).

A container with a readinessProbe starts unready. The kubelet probes it every
``periodSeconds`` from ``initialDelaySeconds`` after its start; a response in [200, 400)
within ``timeoutSeconds`` is a success. ``successThreshold`` successes in a row make it ready,
``failureThreshold`` failures in a row unready again, and the container's ``ready`` in the
pod's status follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

Obj = dict[str, Any]


@dataclass
class ReadinessProbe:
    """One container's probe and its state."""

    url: str
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3
    next_at: float = 0.0
    """Loop time of the next probe."""
    ready: bool = False
    _oks: int = 0
    _fails: int = 0

    @classmethod
    def of(cls, container: Obj, ip: str, *, started_at: float) -> ReadinessProbe | None:
        """The container's ``httpGet`` readinessProbe at ``ip`` (None: it has none)."""
        probe = container.get("readinessProbe") or {}
        get = probe.get("httpGet")
        if not get:
            return None
        port = get.get("port")
        if isinstance(port, str) and not port.isdigit():
            named = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
            port = named.get(port)
            if port is None:
                raise ValueError(f"readinessProbe: no container port named {get['port']!r}")
        path = get.get("path") or "/"
        return cls(
            url=f"http://{ip}:{int(port)}{path if path.startswith('/') else '/' + path}",
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
            next_at=started_at + float(probe.get("initialDelaySeconds", 0)),
        )

    def due(self, now: float) -> bool:
        """Whether a probe is due; if so, the next one is scheduled a period on."""
        if now < self.next_at:
            return False
        self.next_at = now + self.period_s
        return True

    def record(self, ok: bool) -> bool:
        """Count one probe's result; True when the container's readiness changed."""
        self._oks, self._fails = (self._oks + 1, 0) if ok else (0, self._fails + 1)
        was = self.ready
        if ok and self._oks >= self.success_threshold:
            self.ready = True
        elif not ok and self._fails >= self.failure_threshold:
            self.ready = False
        return self.ready != was

    async def check(self, http: aiohttp.ClientSession) -> bool:
        """One probe: a response in [200, 400) within the timeout."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with http.get(self.url, timeout=timeout, allow_redirects=False) as resp:
                return 200 <= resp.status < 400
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False
