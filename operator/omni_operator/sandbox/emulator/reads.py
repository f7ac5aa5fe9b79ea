"""The emulated API server's reads: discovery, get and list with selectors and the Tables
``kubectl get`` asks for, watch streams, and pod logs.

kmock ignores label and field selectors and replays every object on a watch whatever
resourceVersion it starts from: :class:`Reads` filters both. Pod logs are served from
:attr:`Reads.pod_logs` (the sandbox's kubelet keeps them in files).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from omni_operator.sandbox.emulator.selectors import matches_fields, matches_labels
from omni_operator.sandbox.emulator.writes import Writes
from omni_operator.sandbox.tables import as_table

Obj = dict[str, Any]
SERVER_VERSION = "1.33"
"""The Kubernetes the emulator reports at ``/version`` (its API is that of recent releases:
watch-lists, server-side apply)."""


@attrs.define(kw_only=True)
class Reads(Writes):
    """Get, list and watch as an API server answers them."""

    pod_logs: Callable[[str, str], str | None] | None = None
    """Serves ``pods/<name>/log`` (``kubectl logs``): (namespace, name) -> text or None."""

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        """kmock names the core group version ``/v1`` and gives subresources the short names
        of their resource; kubectl wants ``v1`` and short names on the resource only."""
        doc = await super()._serve_version(request)
        doc["groupVersion"] = doc["groupVersion"].lstrip("/")
        for res in doc["resources"]:
            if "/" in res["name"]:
                res.update(singularName="", shortNames=[])
        return doc

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        """``/version``: a Kubernetes the chart supports (kmock says 1.26, which Helm refuses
        for the chart's ``kubeVersion: >=1.27.0-0``); the build names the sandbox."""
        doc = await super()._serve_server_version(request)
        major, minor = SERVER_VERSION.split(".")
        return {**doc, "major": major, "minor": minor,
                "gitVersion": f"v{SERVER_VERSION}.0+omni-sandbox"}  # fmt: skip

    def _selected(self, request: rendering.Request, obj: Obj) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return matches_labels(request.params.get("labelSelector"), labels) and matches_fields(
            request.params.get("fieldSelector"), obj
        )

    def _table(self, request: rendering.Request, objs: list[Obj]) -> Obj | None:
        """The Table ``kubectl get`` asks for, or None when the client wants objects."""
        accept = request.headers.get("Accept", "")
        if "as=Table" not in accept or request.params.get("watch"):
            return None
        return self._as_table(request, objs)

    def _as_table(self, request: rendering.Request, objs: list[Obj]) -> Obj:
        return as_table(
            objs,
            self._columns.get(request.resource, []),
            resource_version=str(self._rv),
            include_object=request.params.get("includeObject", "Metadata"),
        )

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        obj = await super()._serve_fetch(request)
        return self._table(request, [obj]) or obj

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        result = await super()._serve_list(request)
        items = [o for o in result["items"] if self._selected(request, o)]
        table = self._table(request, items)
        if table is not None:
            return table
        kind = self.resources[request.resource].kind or ""
        return {
            "apiVersion": "v1"
            if not request.resource.group
            else str(request.resource.group) + "/" + str(request.resource.version),
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    async def _serve_watch(
        self, request: rendering.Request, *, since: int | None = None
    ) -> AsyncIterator[rendering.Payload]:
        """Events after resourceVersion ``since`` (default: the request's)."""
        if since is None:
            since = int(request.params.get("resourceVersion") or 0)
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict):
                yield event  # the initial empty chunk that starts the stream
                continue
            obj = event.get("object") or {}
            rv = int((obj.get("metadata") or {}).get("resourceVersion") or 0)
            if rv > since and self._selected(request, obj):
                yield event

    async def _watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """Watch events as JSON lines under ``Content-Type: application/json``, as an API
        server streams them: kmock's stream has no content type (aiohttp sends
        application/octet-stream), which client-go refuses ("no stream serializers registered"):
        ``kubectl get -w`` failed at once and ``kubectl delete`` warned while it waited."""
        assert request._raw_request is not None
        tables = "as=Table" in request.headers.get("Accept", "")  # `kubectl get -w`
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)

        async def send(event: Obj) -> None:
            if tables and event["type"] != "BOOKMARK":  # a one-row Table, as the server does
                event = {**event, "object": self._as_table(request, [event["object"]])}
            await response.write(json.dumps(event).encode() + b"\n")

        with contextlib.suppress(ConnectionError):
            since = None
            if request.params.get("sendInitialEvents") == "true":  # a watch-list (client-go's
                # informers, `kubectl delete` waiting): the objects, then a bookmark that ends them
                listed = await self._serve_list(request)
                for obj in listed["items"]:
                    await send({"type": "ADDED", "object": obj})
                since = int(listed["metadata"]["resourceVersion"])
                end = {"resourceVersion": str(since),
                       "annotations": {"k8s.io/initial-events-end": "true"}}  # fmt: skip
                kind, version = self.resources[request.resource].kind, listed["apiVersion"]
                await send(
                    {
                        "type": "BOOKMARK",
                        "object": {"kind": kind, "apiVersion": version, "metadata": end},
                    }
                )
            async for event in self._serve_watch(request, since=since):
                if isinstance(event, dict):
                    await send(event)
            await response.write_eof()
        return response

    async def _log(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._get(request)  # 404 for a pod that does not exist
        text = self.pod_logs(request.namespace, request.name) if self.pod_logs else None
        if text is None:
            raise kmock.KubernetesError(
                status=400,
                reason="BadRequest",
                message=f'container "trainer" in pod "{request.name}" is waiting to start',
            )
        tail = request.params.get("tailLines")
        if tail:
            text = "".join(text.splitlines(keepends=True)[-int(tail) :])
        return aiohttp.web.Response(text=text, content_type="text/plain")
