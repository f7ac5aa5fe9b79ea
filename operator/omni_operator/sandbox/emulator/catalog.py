"""The resources the emulated API server serves, and its admission of an object.

Discovery (kopf and kubectl find resources there) lists the built-in resources of
:data:`RESOURCES` and every CustomResourceDefinition once it is created (Established), with its
schema, status subresource, short names and printer columns; the OpenAPI v3 documents follow
(:mod:`.openapi`). Admission checks what a real API server checks on every create
(:mod:`.admission`), rejected with 422 and the field paths.
"""

from __future__ import annotations

import datetime
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from omni_operator.sandbox.emulator.admission import admission_problems
from omni_operator.sandbox.emulator.openapi import ANY, openapi_v3
from omni_operator.sandbox.tables import BUILTIN, Column, printer_columns

Obj = dict[str, Any]

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
    # by :mod:`omni_operator.sandbox.deployments`), identity, RBAC (stored, not enforced) and
    # NetworkPolicies (stored, not enforced: the sandbox's network is the loopback)
    ("apps/v1/deployments", "Deployment", True, True, ("deploy",)),
    ("v1/serviceaccounts", "ServiceAccount", True, False, ("sa",)),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, False, ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, False, ()),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, False, ()),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, False, ()),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, False, ("netpol",)),
]  # fmt: skip
CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


def now_iso() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class Catalog(kmock.KubernetesEmulator):
    """kmock's emulator serving :data:`RESOURCES`, CRDs' resources, and their admission."""

    _status_sub: set[Any] = attrs.field(factory=set, init=False)
    _namespaced: dict[Any, bool] = attrs.field(factory=dict, init=False)
    _columns: dict[Any, list[Column]] = attrs.field(factory=dict, init=False)
    _schemas: dict[Any, Obj] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced, status, short in RESOURCES:
            self.declare(key, kind=kind, namespaced=namespaced, status=status, short_names=short)

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
        now = now_iso()
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
