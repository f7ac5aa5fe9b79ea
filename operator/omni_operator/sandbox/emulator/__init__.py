"""kmock's Kubernetes emulator with the API server behaviour the operator relies on filled in.

kmock 0.8 stores objects and streams watch events, but: objects get no uid / resourceVersion /
creationTimestamp / generateName, label and field selectors are ignored, ``/status`` is not a
subresource, JSON patches (kopf's finalizers) and resourceVersion preconditions are unknown, and a
watch replays every object whatever resourceVersion it starts from. :class:`Emulator` fills them
in layers, each a class over the one below:

* :mod:`.catalog`: the served resources (built-in, and a CRD's once it is created), OpenAPI v3
  (:mod:`.openapi`) and admission (:mod:`.admission`: the name, a CRD's schema, 422 with the
  field paths);
* :mod:`.store`: stamped objects under one resourceVersion counter, persisted like etcd;
* :mod:`.writes`: create, patch, server-side apply, PUT, ``dryRun=All``, graceful pod deletion;
* :mod:`.reads`: selectors (:mod:`.selectors`), Tables, watch streams, pod logs;
* this module: request routing, body limits and protobuf bodies of Secrets, ConfigMaps and
  Namespaces (:mod:`omni_operator.sandbox.protobuf`).

What it still does not do, on purpose: garbage collection by ownerReferences (the operator must
clean up itself here; the sandbox's Deployment emulation removes its own pods), strategic merge
(a strategic patch is applied as a JSON merge patch), RBAC or token checks.
"""

from __future__ import annotations

import json

import aiohttp.web
import attrs
import kmock
from kmock._internal import parsing, rendering

from omni_operator.sandbox import protobuf
from omni_operator.sandbox.emulator.admission import MAX_DEPTH, nesting_depth
from omni_operator.sandbox.emulator.reads import Reads

_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> parsing.ParsedPath:
    """kmock reads ``/api/v1/namespaces[/<name>]`` as a namespace with no resource (and fails
    on the bare list); the API server means the Namespace objects."""
    parsed = _parse_path(path) if path.strip("/") != "api/v1/namespaces" else None
    parts = path.strip("/").split("/")
    if parsed is None or (parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 4):
        name = parts[3] if len(parts) == 4 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, None)
    return parsed


parsing.parse_path = _parse_path_with_namespaces

MAX_BODY_BYTES = 1024**2
"""aiohttp's default request limit, which the emulator's server keeps (1 MiB)."""


def _failure(code: int, reason: str, message: str) -> aiohttp.web.StreamResponse:
    """A ``Status`` failure as the API server answers it (kubectl prints its message)."""
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
              "reason": reason, "message": message}  # fmt: skip
    return aiohttp.web.json_response(status, status=code)


@attrs.define(kw_only=True)
class Emulator(Reads):
    """A stateful API server close enough to the real one for kopf and kubectl."""

    keep_requests: bool = False
    """Keep every served request in kmock's request log (tests that assert on it); else the log
    holds the requests in flight only. kmock finds whether a reaction sees a request by scanning
    the whole log, so a log of every request makes each read cost more than the one before: a
    sandbox job of a few minutes had the API server busy on one core of two, 87 % of it in that
    scan."""

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if "protobuf" in raw_request.headers.get("Content-Type", ""):
            # client-go's typed clients (`kubectl create secret|configmap`, Helm's release
            # storage) send built-in kinds as protobuf and do not retry in JSON
            # (kubernetes#86253): Secrets and ConfigMaps are read as their JSON objects
            obj = protobuf.decode(await raw_request.read()) if raw_request.can_read_body else None
            if obj is None:
                message = (
                    "the sandbox's API server reads JSON (protobuf: only Secrets, ConfigMaps "
                    "and Namespaces): send JSON (`kubectl apply` does)"
                )
                return _failure(415, "UnsupportedMediaType", message)
            raw_request._read_bytes = json.dumps(obj).encode()  # what kmock parses next
        size = raw_request.content_length or 0
        try:
            if size > MAX_BODY_BYTES:
                raise aiohttp.web.HTTPRequestEntityTooLarge(
                    max_size=MAX_BODY_BYTES, actual_size=size
                )
            return await super().__call__(raw_request)
        except aiohttp.web.HTTPRequestEntityTooLarge:
            return _failure(413, "RequestEntityTooLarge", f"the request body is {size or 'over'} "
                            f"{MAX_BODY_BYTES} bytes, more than the API server takes (etcd keeps "
                            "objects under 1.5 MiB): move large data out of the manifest, e.g. "
                            "into a volume")  # fmt: skip
        finally:
            if not self.keep_requests:  # served: out of the logs (see keep_requests)
                for log in (self._requests, *(p._requests for p in self._payloads)):
                    log[:] = [r for r in log if r._raw_request is not raw_request]

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.url.path.startswith("/openapi/v3"):
            return self._openapi(request.url.path.removeprefix("/openapi/v3").strip("/"))
        if request.subresource == "log" and request.resource == kmock.resource("v1/pods"):
            return await self._log(request)
        if request.action == kmock.action.WATCH and request.resource is not None:
            return await self._watch(request)
        if request.resource is None or request.subresource not in (None, "status"):
            return await super()._handle(request)
        if request.action == kmock.action.CREATE and request.name is None:
            write = self._create
        elif request.method == "PUT" and request.name is not None:
            write = self._replace
        elif request.action == kmock.action.UPDATE and request.name is not None:
            write = self._patch
        elif request.action == kmock.action.DELETE and request.name is not None:
            write = self._delete
        else:
            return await super()._handle(request)
        if (depth := nesting_depth(request.data)) > MAX_DEPTH:
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f"the object nests {depth} levels deep, more than the {MAX_DEPTH} the "
                "sandbox's API server reads: no manifest field needs that; flatten it",
            )
        response = await write(request)
        self.persist()
        return response
