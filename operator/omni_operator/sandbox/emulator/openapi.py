"""The OpenAPI v3 documents the emulated API server serves for its resources (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
ANY: Obj = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
"""The schema served for built-in kinds (the emulator checks only their names)."""


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
