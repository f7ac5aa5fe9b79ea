"""A small async Kubernetes API client for the handlers (aiohttp, kopf's credentials).

kopf's own API client is private, and the sync ``kubernetes`` client would block the event loop
kopf (and, in tests, the API emulator) runs on. The handlers need a handful of verbs on a few
kinds, so this speaks plain JSON over HTTP with the ConnectionInfo the login handler produced.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import aiohttp
import kopf

from omni_operator.rbac import HANDLER_RULES, Rule, rule_of
from omni_operator.spec import GROUP, PLURAL, VERSION

Obj = dict[str, Any]
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Node": "nodes",
    "PodGroup": "podgroups",
    "PriorityClass": "priorityclasses",
    "OmniTrainingJob": PLURAL,
}
JOB_API = f"{GROUP}/{VERSION}"


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def url_path(
    api_version: str,
    kind: str,
    *,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """``/api/v1/namespaces/ns/pods/name`` and the like."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(PLURALS[kind])
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def obj_path(obj: Mapping[str, Any], *, subresource: str | None = None) -> str:
    meta = obj["metadata"]
    return url_path(
        obj["apiVersion"],
        obj["kind"],
        namespace=meta.get("namespace"),
        name=meta["name"],
        subresource=subresource,
    )


class Kube:
    """The API server the operator talks to; :meth:`use` swaps credentials on (re-)login."""

    def __init__(self, info: kopf.ConnectionInfo | None = None, *, concurrency: int = 32) -> None:
        self.info = info
        self._session: aiohttp.ClientSession | None = None
        self._limit = asyncio.Semaphore(concurrency)
        self.requests = 0
        """Requests sent (the benchmark reports requests per reconcile)."""
        self.used: set[Rule] = set()
        """RBAC rules this client has needed (tests check the chart grants no more)."""

    def use(self, info: kopf.ConnectionInfo) -> None:
        self.info = info
        if self._session is not None and not self._session.closed:
            asyncio.get_running_loop().create_task(self._session.close())
        self._session = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _make_session(self) -> aiohttp.ClientSession:
        info = self.info
        if info is None:
            raise RuntimeError("not logged in: the login handler has not run")
        headers = {"Accept": "application/json", **info.as_http_headers()}
        ssl_ctx: ssl.SSLContext | bool = True
        if info.server.startswith("https"):
            if info.insecure:
                ssl_ctx = False
            else:
                ctx = ssl.create_default_context(
                    cafile=os.fsdecode(info.ca_path) if info.ca_path else None,
                    cadata=_text(info.ca_data) if info.ca_data else None,
                )
                with (
                    _pem_file(info.certificate_path, info.certificate_data) as cert,
                    _pem_file(info.private_key_path, info.private_key_data) as key,
                ):
                    if cert:
                        ctx.load_cert_chain(cert, key)  # read now: the temp files can go
                ssl_ctx = ctx
        return aiohttp.ClientSession(
            base_url=info.server.rstrip("/") + "/",
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=ssl_ctx, limit=64),
            timeout=aiohttp.ClientTimeout(total=60, connect=10),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One API call; returns the decoded JSON or raises :class:`ApiError`."""
        rule = rule_of(method, path, params)
        if rule not in HANDLER_RULES:
            raise PermissionError(
                f"the operator may not {rule[2]} {rule[1]} (group {rule[0]!r}): add it to "
                "omni_operator/rbac.py HANDLER_RULES and the chart's RBAC, or do not call it"
            )
        self.used.add(rule)
        if self._session is None or self._session.closed:
            self._session = self._make_session()
        async with self._limit:
            self.requests += 1
            async with self._session.request(
                method,
                path.lstrip("/"),
                json=body,
                params=params,
                headers={"Content-Type": content_type} if body is not None else None,
            ) as resp:
                data = await resp.json(content_type=None) if resp.content_length != 0 else None
                if resp.status >= 400:
                    data = data if isinstance(data, dict) else {}
                    raise ApiError(resp.status, str(data.get("reason")), str(data.get("message")))
                return data

    async def get(self, path: str) -> Obj | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(self, path: str, *, label_selector: str | None = None) -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        try:
            data = await self.request("GET", path, params=params)
        except ApiError as err:
            if err.status == 404:  # an API that is not installed (e.g. no Volcano)
                return []
            raise
        kind = (data.get("kind") or "").removesuffix("List")
        api_version = data.get("apiVersion")
        items = data.get("items") or []
        for item in items:  # list items omit apiVersion/kind on a real API server
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
        return items

    async def create(self, obj: Obj) -> Obj | None:
        """Create; None when an object of that name already exists (adopted on the next pass)."""
        meta = obj["metadata"]
        path = url_path(obj["apiVersion"], obj["kind"], namespace=meta.get("namespace"))
        try:
            return await self.request("POST", path, body=obj)
        except ApiError as err:
            if err.status == 409:
                return None
            raise

    async def patch(self, path: str, body: Obj) -> Obj | None:
        """JSON merge patch; None when the object is gone."""
        try:
            return await self.request(
                "PATCH", path, body=body, content_type="application/merge-patch+json"
            )
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def delete(self, path: str, *, grace_seconds: int | None = None) -> None:
        """Delete (idempotent: a missing object is fine). ``grace_seconds=0`` forces it."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            await self.request("DELETE", path, body=body)
        except ApiError as err:
            if err.status != 404:
                raise

    async def gather(self, calls: Iterable[Any]) -> None:
        """Run API calls concurrently (bounded by the client's concurrency); the first error
        is raised after all have finished, so one failure does not orphan the others."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]


def _text(value: str | bytes) -> str:
    """CA data from kubeconfig arrives base64-encoded or as PEM text."""
    raw = value.decode() if isinstance(value, bytes) else value
    if "BEGIN CERTIFICATE" in raw:
        return raw
    return base64.b64decode(raw).decode()


@contextlib.contextmanager
def _pem_file(path: Any, data: str | bytes | None) -> Iterator[str | None]:
    """A file path for ssl (which only loads client certificates from files): the given path,
    or the inline data in an owner-only temp file that is removed on exit."""
    if path:
        yield os.fsdecode(path)
        return
    if not data:
        yield None
        return
    raw = data.encode() if isinstance(data, str) else data
    if b"BEGIN" not in raw:
        raw = base64.b64decode(raw)
    fd, name = tempfile.mkstemp(prefix="omni-", suffix=".pem")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        yield name
    finally:
        os.unlink(name)
