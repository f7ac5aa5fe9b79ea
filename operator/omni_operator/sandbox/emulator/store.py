"""The emulated API server's objects: stamped, looked up, published to watches, persisted.

kmock stores objects and streams watch events, but gives them no uid, resourceVersion or
creationTimestamp: :class:`Store` stamps them with one counter of resource versions. With a
:attr:`Store.store`, every write is persisted and restored on the next start, as etcd would
keep it.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import attrs
import kmock
from kmock._internal import rendering

from omni_operator.sandbox.emulator.catalog import CRDS, Catalog, now_iso

Obj = dict[str, Any]


def _resource_key(res: Any) -> str:
    """``group/version/plural`` (``v1/pods`` for the core group), as :func:`kmock.resource`
    reads it back."""
    return "/".join(str(p) for p in (res.group, res.version, res.plural) if p)


@attrs.define(kw_only=True)
class Store(Catalog):
    """The objects under one resourceVersion counter (``default`` and ``kube-system`` exist)."""

    _rv: int = attrs.field(default=0, init=False)
    store: Path | None = None
    """Where every write is persisted (JSON), like etcd: :meth:`restore` reads it back after a
    restart, so jobs, pods and their status survive the API server."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for ns in ("default", "kube-system"):
            self._objects["v1/namespaces", None, ns] = self._stamp(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            )

    def persist(self) -> None:
        """Write every live object (and the resourceVersion counter) to :attr:`store`."""
        if self.store is None:
            return
        objects = [
            [_resource_key(res), ns, obj.raw]
            for (res, ns, _), obj in self._objects.items()
            if not obj.deleted
        ]
        tmp = self.store.with_suffix(".tmp")
        tmp.write_text(json.dumps({"resourceVersion": self._rv, "objects": objects}))
        tmp.replace(self.store)

    def restore(self) -> int:
        """Load what :meth:`persist` wrote (nothing if there is no store yet); how many objects."""
        if self.store is None or not self.store.exists():
            return 0
        state = json.loads(self.store.read_text())
        for key, ns, raw in state["objects"]:
            self._objects[kmock.resource(key), ns, raw["metadata"]["name"]] = raw
            if kmock.resource(key) == CRDS:
                self.serve_crd(raw)
        self._rv = max(self._rv, int(state["resourceVersion"]))
        return len(state["objects"])

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _stamp(self, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_iso())
        meta["resourceVersion"] = self._next_rv()
        meta.setdefault("generation", 1)
        return obj

    def _get(self, request: rendering.Request) -> tuple[Any, Obj]:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesError(
                status=404,
                reason="NotFound",
                message=f"{request.resource.plural} {request.name!r} not found",
            )
        return key, copy.deepcopy(self._objects[key].raw)

    async def _publish(self, request: rendering.Request, kind: str, obj: Obj) -> None:
        await self._buses[request.resource].put({"type": kind, "object": copy.deepcopy(obj)})

    def stored(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        """The stored object, or None (a test's direct look, no HTTP)."""
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def stored_all(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """Every live object of a resource (optionally one namespace), sorted by name."""
        res = kmock.resource(resource)
        out = [
            copy.deepcopy(obj.raw)
            for (r, ns, _), obj in self._objects.items()
            if r == res and not obj.deleted and (namespace is None or ns == namespace)
        ]
        return sorted(out, key=lambda o: o["metadata"]["name"])
