"""kmock's Kubernetes emulator with the gaps of shared/ENVIRONMENT.md filled.

kmock 0.8 stores objects and streams watch events, but: objects get no uid / resourceVersion /
creationTimestamp / generateName, label and field selectors are ignored, ``/status`` is not a
subresource, JSON patches (kopf's finalizers) and resourceVersion preconditions are unknown, and a
watch replays every object whatever resourceVersion it starts from. :class:`Emulator` takes over
the writes (create, patch, delete) with those semantics and filters reads. It also takes what
Helm and client-go send: a server-side apply (creates the object when absent, else is merged as
a JSON merge patch: no field ownership), PUT (a replacement under its resourceVersion),
``dryRun=All`` (admitted, answered, not stored) and protobuf bodies of Secrets, ConfigMaps and
Namespaces (:mod:`.protobuf`); a CRD's resource is served once the CRD is created (Established).
What it still does not do, on purpose: garbage collection by ownerReferences (the operator must
clean up itself here; the sandbox's Deployment emulation removes its own pods), strategic merge
(a strategic patch is applied as a JSON merge patch), RBAC or token checks. Admission checks what
a real API server checks on every create: the name (a DNS-1123 subdomain) and, for a resource
declared with a schema (a CRD's ``openAPIV3Schema``), the object against it, rejected with 422
and the field paths. Pod logs are served from :attr:`Emulator.pod_logs` (the sandbox's kubelet
keeps them in files). With a :attr:`Emulator.store`, every write is persisted and restored on
the next start, as etcd would keep it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonschema
import kmock
import yaml
from kmock._internal import parsing, rendering

from omni_operator.sandbox import protobuf
from omni_operator.sandbox.tables import BUILTIN, Column, as_table, printer_columns

Obj = dict[str, Any]
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

# The resources the operator and the tests use: (group/version/plural, kind, namespaced, status,
# short names as a real API server lists them: `kubectl get svc` works).
# ``status``: /status is a subresource (writes to the main resource leave status alone and back).
RESOURCES: list[tuple[str, str, bool, bool, tuple[str, ...]]] = [
    ("v1/namespaces", "Namespace", False, False, ("ns",)),
    ("v1/nodes", "Node", False, False, ("no",)),
    ("v1/pods", "Pod", True, True, ("po",)),
    ("v1/services", "Service", True, False, ("svc",)),
    ("v1/configmaps", "ConfigMap", True, False, ("cm",)),
    ("v1/secrets", "Secret", True, False, ()),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, True, ("pvc",)),
    ("v1/events", "Event", True, False, ("ev",)),
    ("events.k8s.io/v1/events", "Event", True, False, ("ev",)),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, True,
     ("crd", "crds")),
    ("scheduling.volcano.sh/v1beta1/podgroups", "PodGroup", True, True, ("pg",)),
    ("scheduling.k8s.io/v1/priorityclasses", "PriorityClass", False, False, ("pc",)),
    # what the chart renders (`helm install` into the sandbox): its operator's Deployment (run
    # by :mod:`.deployments`), identity, RBAC (stored, not enforced) and NetworkPolicies (stored,
    # not enforced: the sandbox's network is the loopback)
    ("apps/v1/deployments", "Deployment", True, True, ("deploy",)),
    ("v1/serviceaccounts", "ServiceAccount", True, False, ("sa",)),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, False, ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, False, ()),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, False, ()),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, False, ()),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, False, ("netpol",)),
]  # fmt: skip
SERVER_VERSION = "1.33"
"""The Kubernetes the emulator reports at ``/version`` (its API is that of recent releases:
watch-lists, server-side apply)."""
CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``None`` removes, the rest replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def matches_labels(selector: str | None, labels: Mapping[str, str]) -> bool:
    """``a=b,c!=d,e,!f,g in (x,y),h notin (z)``: the label selector syntax of the API server."""
    if not selector:
        return True
    for term in _split_terms(selector):
        term = term.strip()
        if " notin " in term or " in " in term:
            neg = " notin " in term
            key, values = term.split(" notin " if neg else " in ", 1)
            allowed = {v.strip() for v in values.strip().strip("()").split(",")}
            ok = labels.get(key.strip()) in allowed
            if ok == neg:
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _split_terms(selector: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    return [*terms, cur]


ANY: Obj = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
"""The schema served for built-in kinds (the emulator checks only their names)."""
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def admission_problems(obj: Obj, schema: Obj | None) -> list[tuple[str, str]]:
    """What a real API server says about an object it rejects: (field, ``Invalid value: ...``)
    per problem (the name must be a DNS-1123 subdomain; ``schema``: a CRD's, OpenAPI 3.0)."""
    out = []
    name = obj["metadata"]["name"]
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        out.append((
            "metadata.name",
            f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower '
            "case alphanumeric characters, '-' or '.', and must start and end with an "
            "alphanumeric character (e.g. 'example.com', regex used for validation is "
            f"'{_SUBDOMAIN.pattern}')",
        ))  # fmt: skip
    if schema is not None:
        body = {k: v for k, v in obj.items() if k not in ("status", "metadata")}
        validator = jsonschema.Draft4Validator(_strip_status(schema))  # OpenAPI 3.0's dialect
        for err in sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in err.absolute_path) or "<root>"
            out.append((path, f"Invalid value: {json.dumps(err.instance)[:80]}: {err.message}"))
    return out


def openapi_v3(schemas: Mapping[Any, tuple[str, bool, Obj]]) -> dict[str, Obj]:
    """Per ``apis/<group>/<version>`` (``api/v1``), an OpenAPI v3 document of its resources
    (kind, namespaced, schema): the object schema, and the paths with their operations and the
    ``fieldValidation`` parameter."""
    docs: dict[str, Obj] = {}
    for res, (kind, namespaced, schema) in schemas.items():
        group, version, plural = res.group, res.version, res.plural
        gv = f"apis/{group}/{version}" if group else f"api/{version}"
        prefix = ".".join(reversed(group.split("."))) if group else "io.k8s.api.core"
        ref = f"{prefix}.{version}.{kind}"
        one = {"group": group or "", "version": version, "kind": kind}
        gvk = {"x-kubernetes-group-version-kind": one}  # operations name one, schemas a list
        body = {
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}
        }
        params = [{"name": n, "in": "query", "schema": {"type": "string"}}
                  for n in ("dryRun", "fieldManager", "fieldValidation")]  # fmt: skip
        ops = {verb: {"operationId": f"{verb}{kind}", "parameters": params, "requestBody": body,
                      "responses": {"200": body}, **gvk}
               for verb in ("get", "put", "patch", "delete")}  # fmt: skip
        base = f"/{gv}{'/namespaces/{namespace}' if namespaced else ''}/{plural}"
        info = {"title": "Kubernetes", "version": "sandbox"}
        doc = docs.setdefault(
            gv, {"openapi": "3.0.0", "info": info, "paths": {}, "components": {"schemas": {}}}
        )
        doc["paths"][f"{base}/{{name}}"] = ops
        doc["paths"][base] = {"post": {**ops["get"], "operationId": f"create{kind}"}}
        doc["components"]["schemas"][ref] = {**schema, "x-kubernetes-group-version-kind": [one]}
    return docs


def _resource_key(res: Any) -> str:
    """``group/version/plural`` (``v1/pods`` for the core group), as :func:`kmock.resource`
    reads it back."""
    return "/".join(str(p) for p in (res.group, res.version, res.plural) if p)


def _strip_status(schema: Obj) -> Obj:
    """The schema without ``status`` and ``metadata`` (written through /status, checked apart)."""
    props = {k: v for k, v in (schema.get("properties") or {}).items()
             if k not in ("status", "metadata")}  # fmt: skip
    return {**schema, "properties": props}


def _field(obj: Obj, path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    return cur


def matches_fields(selector: str | None, obj: Obj) -> bool:
    """``metadata.name=x,spec.nodeName!=y``: equality field selectors on any dotted path."""
    if not selector:
        return True
    for term in selector.split(","):
        neg = "!=" in term
        key, value = term.split("!=" if neg else "=", 1)
        actual = _field(obj, key.strip().lstrip("="))
        if (str(actual if actual is not None else "") == value.strip()) == neg:
            return False
    return True


MAX_BODY_BYTES = 1024**2
"""aiohttp's default request limit, which the emulator's server keeps (1 MiB)."""


MAX_DEPTH = 100
"""The deepest object a write may carry (copies and merges of deeper ones recurse too far)."""


def nesting_depth(value: Any) -> int:
    """How many mappings and lists deep ``value`` nests (iteratively: any depth is measured)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _dry_run(request: rendering.Request) -> bool:
    """``?dryRun=All``: the write is admitted and answered, nothing is stored."""
    return request.params.get("dryRun") == "All"


def _failure(code: int, reason: str, message: str) -> aiohttp.web.StreamResponse:
    """A ``Status`` failure as the API server answers it (kubectl prints its message)."""
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
              "reason": reason, "message": message}  # fmt: skip
    return aiohttp.web.json_response(status, status=code)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """A stateful API server close enough to the real one for kopf and kubectl."""

    _rv: int = attrs.field(default=0, init=False)
    _status_sub: set[Any] = attrs.field(factory=set, init=False)
    _namespaced: dict[Any, bool] = attrs.field(factory=dict, init=False)
    _columns: dict[Any, list[Column]] = attrs.field(factory=dict, init=False)
    _schemas: dict[Any, Obj] = attrs.field(factory=dict, init=False)
    before_create: Callable[[Obj], Awaitable[None]] | None = None
    """Awaited before an object is stored: tests delay or interleave creations with it."""
    pod_logs: Callable[[str, str], str | None] | None = None
    """Serves ``pods/<name>/log`` (``kubectl logs``): (namespace, name) -> text or None."""
    store: Path | None = None
    """Where every write is persisted (JSON), like etcd: :meth:`restore` reads it back after a
    restart, so jobs, pods and their status survive the API server."""
    graceful_pods: bool = False
    """Graceful pod deletion, as with a kubelet: deleting a pod that runs on a node only marks
    it (``deletionTimestamp``, ``deletionGracePeriodSeconds``: the DeleteOptions', else the
    pod's ``terminationGracePeriodSeconds``); the kubelet removes it once its containers stopped.
    A grace of 0 removes it at once (a forced deletion). Off where no kubelet runs."""
    keep_requests: bool = False
    """Keep every served request in kmock's request log (tests that assert on it); else the log
    holds the requests in flight only. kmock finds whether a reaction sees a request by scanning
    the whole log, so a log of every request makes each read cost more than the one before: a
    sandbox job of a few minutes had the API server busy on one core of two, 87 % of it in that
    scan."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced, status, short in RESOURCES:
            self.declare(key, kind=kind, namespaced=namespaced, status=status, short_names=short)
        for ns in ("default", "kube-system"):
            self._objects["v1/namespaces", None, ns] = self._stamp(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            )

    def declare(
        self,
        key: str,
        *,
        kind: str,
        namespaced: bool,
        status: bool,
        short_names: Any = (),
        columns: list[Column] | None = None,
        schema: Obj | None = None,
    ) -> None:
        """Serve a resource in discovery (kopf and kubectl find resources there); ``columns``
        are what ``kubectl get`` prints (a CRD's printer columns); ``schema`` (a CRD's
        ``openAPIV3Schema``) is enforced on every write but status."""
        self.resources[key] = kmock.ResourceInfo(
            kind=kind,
            namespaced=namespaced,
            singular=kind.lower(),
            verbs=VERBS,
            shortnames=set(short_names),
            subresources={"status"} if status else set(),
        )
        res = kmock.resource(key)
        self._namespaced[res] = namespaced
        self._columns[res] = columns if columns is not None else BUILTIN.get(kind, [])
        if status:
            self._status_sub.add(res)
        if schema is not None:
            self._schemas[res] = schema

    def serve_crd(self, definition: Obj) -> Obj:
        """Serve a CustomResourceDefinition's resource (its storage version, schema, status
        subresource, short names, printer columns) unless it is served already, as an API
        server does once it is created; returns the status it reports (Established)."""
        spec = definition["spec"]
        names = spec["names"]
        version = next((v for v in spec["versions"] if v.get("storage")), spec["versions"][0])
        key = f"{spec['group']}/{version['name']}/{names['plural']}"
        if kmock.resource(key) not in self._namespaced:
            self.declare(
                key,
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                status="status" in (version.get("subresources") or {}),
                short_names=names.get("shortNames", ()),
                columns=printer_columns(definition),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            )
        now = _now()
        return {
            "acceptedNames": names,
            "storedVersions": [version["name"]],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m,
                 "lastTransitionTime": now}
                for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                ("Established", "InitialNamesAccepted",
                                 "the initial names have been accepted"))
            ],
        }  # fmt: skip

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
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = self._next_rv()
        meta.setdefault("generation", 1)
        return obj

    # -- writes ------------------------------------------------------------------------------

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

    async def _publish(self, request: rendering.Request, kind: str, obj: Obj) -> None:
        await self._buses[request.resource].put({"type": kind, "object": copy.deepcopy(obj)})

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

    def _openapi(self, group_version: str) -> aiohttp.web.StreamResponse:
        """OpenAPI v3 of the served resources (a CRD's schema; any object for built-in kinds):
        kubectl reads that the server validates fields (``fieldValidation``) and leaves
        validation to admission, so a plain ``kubectl apply`` (no ``--validate=false``) works
        and its errors come from the server."""
        docs = openapi_v3({res: (self.resources[res].kind or "", namespaced,
                                 self._schemas.get(res, ANY))
                           for res, namespaced in self._namespaced.items()})  # fmt: skip
        if not group_version:
            paths = {gv: {"serverRelativeURL": f"/openapi/v3/{gv}"} for gv in docs}
            return aiohttp.web.json_response({"paths": paths})
        if group_version not in docs:
            raise kmock.KubernetesError(status=404, reason="NotFound", message="no such spec")
        return aiohttp.web.json_response(docs[group_version])

    def _admit(self, request: rendering.Request, obj: Obj) -> None:
        """Reject (422 Invalid, every problem with its field path) what a real API server
        rejects: a name that is not a DNS-1123 subdomain, an object its CRD schema rejects."""
        causes = admission_problems(obj, self._schemas.get(request.resource))
        if causes:
            kind = self.resources[request.resource].kind or ""
            group = request.resource.group
            name = obj["metadata"]["name"]
            what = f"{kind}.{group}" if group else kind
            lines = [f"{field}: {msg}" for field, msg in causes]
            listed = lines[0] if len(lines) == 1 else "[" + ", ".join(lines) + "]"
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f'{what} "{name}" is invalid: {listed}',
                details={"name": name, "group": group or "", "kind": kind,
                         "causes": [{"reason": "FieldValueInvalid", "message": msg,
                                     "field": field} for field, msg in causes]},
            )  # fmt: skip

    def _get(self, request: rendering.Request) -> tuple[Any, Obj]:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesError(
                status=404,
                reason="NotFound",
                message=f"{request.resource.plural} {request.name!r} not found",
            )
        return key, copy.deepcopy(self._objects[key].raw)

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
                    else _merge(old, body or {})
                )
            if request.resource in self._status_sub:
                if request.subresource == "status":
                    new = {**old, "status": new.get("status")}
                else:
                    new["status"] = old.get("status")
                new = {k: v for k, v in new.items() if v is not None}
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
                    meta["deletionTimestamp"] = _now()
                    meta["deletionGracePeriodSeconds"] = grace
                    meta["resourceVersion"] = self._next_rv()
                    self._objects[key].history.append(obj)
                    await self._publish(request, "MODIFIED", obj)
            elif meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = _now()
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

    # -- reads -------------------------------------------------------------------------------

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

    # -- helpers for tests -------------------------------------------------------------------

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
