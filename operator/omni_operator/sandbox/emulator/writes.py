"""The emulated API server's writes: create, patch, replace, delete, as the real one does them.

kmock's own writes give objects no generateName and ignore resourceVersion preconditions, the
status subresource, JSON patches (kopf's finalizers) and graceful deletion: :class:`Writes`
serves them with those semantics. It also takes what Helm and client-go send: a server-side
apply (creates the object when absent, else is merged as a JSON merge patch: no field
ownership), PUT (a replacement under its resourceVersion) and ``dryRun=All`` (admitted,
answered, not stored). A strategic merge patch is applied as a JSON merge patch.
"""

from __future__ import annotations

import copy
import datetime
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import rendering

from omni_operator.sandbox.emulator.catalog import CRDS, now_iso
from omni_operator.sandbox.emulator.store import Store

Obj = dict[str, Any]
API_TIMES = {"firstTimestamp": "%Y-%m-%dT%H:%M:%SZ", "lastTimestamp": "%Y-%m-%dT%H:%M:%SZ",
             "eventTime": "%Y-%m-%dT%H:%M:%S.%fZ"}  # fmt: skip
"""An Event's times as the API server stores them: RFC 3339 in UTC with ``Z`` (metav1.Time to
the second, MicroTime to the microsecond), whatever offset or precision a client posted (kopf
posts ``+00:00`` with microseconds); kubectl's ``--sort-by=.lastTimestamp`` reads these."""


def api_times(obj: Obj) -> Obj:
    """``obj`` with its :data:`API_TIMES` fields in the API server's form (others untouched)."""
    for key, layout in API_TIMES.items():
        value = obj.get(key)
        if not isinstance(value, str):
            continue
        try:
            then = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            continue
        then = then.replace(tzinfo=datetime.UTC) if then.tzinfo is None else then
        obj[key] = then.astimezone(datetime.UTC).strftime(layout)
    return obj


def merge_patch(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``None`` removes, the rest replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _dry_run(request: rendering.Request) -> bool:
    """``?dryRun=All``: the write is admitted and answered, nothing is stored."""
    return request.params.get("dryRun") == "All"


@attrs.define(kw_only=True)
class Writes(Store):
    """Create, patch (merge, JSON, server-side apply), replace and delete."""

    before_create: Callable[[Obj], Awaitable[None]] | None = None
    """Awaited before an object is stored: tests delay or interleave creations with it."""
    graceful_pods: bool = False
    """Graceful pod deletion, as with a kubelet: deleting a pod that runs on a node only marks
    it (``deletionTimestamp``, ``deletionGracePeriodSeconds``: the DeleteOptions', else the
    pod's ``terminationGracePeriodSeconds``); the kubelet removes it once its containers stopped.
    A grace of 0 removes it at once (a forced deletion). Off where no kubelet runs."""

    async def _create(
        self, request: rendering.Request, data: Any = None
    ) -> aiohttp.web.StreamResponse:
        """POST (or a server-side apply of an object that does not exist: ``data``)."""
        obj = copy.deepcopy(request.data if data is None else data)
        if not isinstance(obj, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="not an object")
        api_times(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="name is required")
        namespaced = self._namespaced.get(request.resource, request.namespace is not None)
        if namespaced:
            meta["namespace"] = request.namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        if request.resource == kmock.resource("v1/secrets"):
            obj["type"] = obj.get("type") or "Opaque"  # the API server's default
        if request.resource in self._status_sub and request.resource != kmock.resource("v1/pods"):
            obj.pop("status", None)  # custom resources: status is written through /status only
        self._admit(request, obj)
        key = (request.resource, meta.get("namespace"), meta["name"])
        if self.before_create is not None:
            await self.before_create(obj)
        async with self._lock:
            if key in self._objects and not self._objects[key].deleted:
                raise kmock.KubernetesError(
                    status=409,
                    reason="AlreadyExists",
                    message=f"{request.resource.plural} {meta['name']!r} already exists",
                )
            if _dry_run(request):  # admitted, not stored (`kubectl apply --dry-run=server`)
                return aiohttp.web.json_response(obj, status=201)
            self._stamp(obj)
            if request.resource == CRDS:
                obj["status"] = self.serve_crd(obj)
            if key in self._objects:
                self._objects[key].create(obj)
            else:
                self._objects[key] = obj
            await self._publish(request, "ADDED", obj)
        return aiohttp.web.json_response(obj, status=201)

    async def _patch(
        self, request: rendering.Request, data: Any = None
    ) -> aiohttp.web.StreamResponse:
        """PATCH (``data``: the body when another write is served as one)."""
        body = request.data if data is None else data
        content_type = request.headers.get("Content-Type", "")
        if "apply-patch" in content_type:  # server-side apply (Helm 4, `kubectl apply
            # --server-side`): the object is created when absent, else merged as below
            applied = body if body is not None else yaml.safe_load(request.text)
            if not isinstance(applied, dict):
                raise kmock.KubernetesError(
                    status=400, reason="BadRequest", message="not an object"
                )
            if (request.resource, request.namespace, request.name) not in self._objects or (
                self._objects[request.resource, request.namespace, request.name].deleted
            ):
                return await self._create(request, applied)
            body = {k: v for k, v in applied.items() if k not in ("apiVersion", "kind")}
        async with self._lock:
            key, old = self._get(request)
            new = self._patched(request, old, body, content_type)
            if new.get("spec") != old.get("spec"):
                self._admit(request, new)
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            if new == old:  # a no-op patch changes nothing and emits no event (like the server)
                return aiohttp.web.json_response(old)
            if _dry_run(request):
                return aiohttp.web.json_response(new)
            new["metadata"]["resourceVersion"] = self._next_rv()
            meta = new["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self._objects[key].delete()
                await self._publish(request, "DELETED", new)
            else:
                self._objects[key].history.append(new)
                await self._publish(request, "MODIFIED", new)
        return aiohttp.web.json_response(new)

    def _patched(self, request: rendering.Request, old: Obj, body: Any, content_type: str) -> Obj:
        """``old`` with the patch ``body`` applied (a JSON patch, else a merge patch under its
        resourceVersion precondition, or a PUT's replacement); status and the main resource
        keep each other's part where /status is a subresource."""
        if "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(old, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message=f"json patch: {err}"
                ) from None
        else:
            want_rv = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(
                    status=409, reason="Conflict", message="the object has been modified"
                )
            new = (
                copy.deepcopy(body)
                if request.method == "PUT"  # see _replace
                else merge_patch(old, body or {})
            )
        if request.resource in self._status_sub:
            if request.subresource == "status":
                new = {**old, "status": new.get("status")}
            else:
                new["status"] = old.get("status")
            new = {k: v for k, v in new.items() if v is not None}
        return new

    async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """PUT (client-go's ``Update``: Helm's release records): the object as sent replaces
        the stored one, under its resourceVersion precondition; /status and the main resource
        keep each other's part as with a patch."""
        sent = request.data if isinstance(request.data, dict) else None
        if sent is None:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="not an object")
        async with self._lock:
            _, old = self._get(request)
        replacement = {k: v for k, v in sent.items() if k != "metadata"}
        meta = {
            **old["metadata"],
            **{
                k: v
                for k, v in (sent.get("metadata") or {}).items()
                if k not in ("uid", "creationTimestamp", "generation")
            },
        }
        for key in ("labels", "annotations", "finalizers", "ownerReferences"):
            if key not in (sent.get("metadata") or {}):
                meta.pop(key, None)  # a replacement without them drops them
        return await self._patch(request, {**replacement, "metadata": meta})

    async def _delete(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        async with self._lock:
            key, obj = self._get(request)
            if _dry_run(request):
                return aiohttp.web.json_response(obj)
            meta = obj["metadata"]
            grace = self._pod_grace(request, obj)
            if grace:
                if grace < meta.get("deletionGracePeriodSeconds", grace + 1):
                    meta["deletionTimestamp"] = now_iso()
                    meta["deletionGracePeriodSeconds"] = grace
                    meta["resourceVersion"] = self._next_rv()
                    self._objects[key].history.append(obj)
                    await self._publish(request, "MODIFIED", obj)
            elif meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = now_iso()
                    meta["resourceVersion"] = self._next_rv()
                    self._objects[key].history.append(obj)
                    await self._publish(request, "MODIFIED", obj)
            else:
                meta["resourceVersion"] = self._next_rv()
                self._objects[key].delete()
                await self._publish(request, "DELETED", obj)
        return aiohttp.web.json_response(obj)

    def _pod_grace(self, request: rendering.Request, obj: Obj) -> int:
        """The grace a pod deletion gets (0: removed at once): only for a pod bound to a node
        and not finished, when :attr:`graceful_pods` is on."""
        if not self.graceful_pods or request.resource != kmock.resource("v1/pods"):
            return 0
        status = obj.get("status") or {}
        if not (obj.get("spec") or {}).get("nodeName") or status.get("phase") in (
            "Succeeded",
            "Failed",
        ):
            return 0
        options = request.data if isinstance(request.data, Mapping) else {}
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        return int(grace)
