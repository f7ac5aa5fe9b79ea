"""The CustomResourceDefinition, generated from the pydantic models (``make crds``).

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no ``$ref``, no type-bearing
``anyOf``/``oneOf``, no ``additionalProperties: false`` (the API server prunes unknown fields
instead), no ``default: null``. pydantic emits JSON Schema 2020-12, so :func:`structural` rewrites
it. The CRD schema is deliberately a relaxation of the model: cross-field checks, map-key enums,
tagged-union members and preset-filled required fields are left to the operator's pydantic
validation, whose messages name the field. ``python -m omni_operator.crd DIR`` writes the file.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from omni_operator.spec import GROUP, PLURAL, VERSION, OmniTrainingJobSpec
from omni_operator.status import OmniTrainingJobStatus

Schema = dict[str, Any]
CRD_NAME = f"{PLURAL}.{GROUP}"
FILE_NAME = f"{CRD_NAME}.yaml"

# Keywords that survive unchanged (all exist in apiextensions.k8s.io/v1 JSONSchemaProps).
_KEEP = {
    "type",
    "description",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "required",
}
# JSON Schema keywords with no structural meaning, or handled by pydantic.
_DROP = {"title", "default", "discriminator", "propertyNames", "$defs", "examples"}


class SchemaConversionError(ValueError):
    """pydantic produced a construct this converter does not know how to make structural."""


def structural(schema: Schema) -> Schema:
    """A structural OpenAPI v3 schema equivalent to (or looser than) a pydantic JSON schema."""
    defs = schema.get("$defs", {})
    return _convert(schema, defs, path="")


def _resolve(node: Schema, defs: Schema) -> Schema:
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        merged = copy.deepcopy(defs[name])
        merged.update({k: v for k, v in node.items() if k != "$ref"})  # field description wins
        node = merged
    return node


def _convert(node: Schema, defs: Schema, path: str) -> Schema:
    node = _resolve(node, defs)
    out: Schema = {}
    default = node.get("default")
    for key in ("anyOf", "oneOf"):
        if key in node:
            return _union(node, node[key], defs, path)
    if "const" in node:
        out["enum"] = [node["const"]]
    for key, value in node.items():
        if key in _KEEP:
            out[key] = copy.deepcopy(value)
        elif key in _DROP or key in {"const", "anyOf", "oneOf"}:
            continue
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "properties":
            out["properties"] = {
                name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()
            }
        elif key == "items":
            out["items"] = _convert(value, defs, f"{path}[]")
        elif key == "uniqueItems":
            if value:
                out["x-kubernetes-list-type"] = "set"  # uniqueItems: true is forbidden
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out["additionalProperties"] = _convert(value, defs, f"{path}.*")
            # False: unknown fields are pruned by the API server and rejected by pydantic.
        elif key == "patternProperties":
            (sub,) = value.values()  # a dict with constrained keys: pydantic checks the keys
            out["additionalProperties"] = _convert(sub, defs, f"{path}.*")
        else:
            raise SchemaConversionError(f"{path or '<root>'}: unsupported keyword {key!r}")
    if out.get("type") == "object" and "properties" in out and "additionalProperties" in out:
        raise SchemaConversionError(f"{path}: both properties and additionalProperties")
    if default is not None and not isinstance(default, dict | list):
        out["description"] = _with_default(out.get("description"), default)
    return out


def _with_default(description: str | None, default: Any) -> str:
    shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
    return f"{description + '; ' if description else ''}default: {shown}"


def _union(node: Schema, members: list[Schema], defs: Schema, path: str) -> Schema:
    """``X | None`` -> nullable X; ``int | str`` -> int-or-string; objects -> merged object."""
    members = [_resolve(m, defs) for m in members]
    nullable = any(m.get("type") == "null" for m in members)
    members = [m for m in members if m.get("type") != "null"]
    outer = {k: v for k, v in node.items() if k not in {"anyOf", "oneOf"}}
    if len(members) == 1:
        out = _convert({**members[0], **outer}, defs, path)
    elif sorted(m.get("type", "") for m in members) == ["integer", "string"]:
        out = _convert(outer, defs, path)
        out["x-kubernetes-int-or-string"] = True
    elif all(m.get("type") == "object" for m in members):
        out = _merge_objects([_convert(m, defs, path) for m in members], path)
        out.update(_convert(outer, defs, path))
    else:
        types = [m.get("type") for m in members]
        raise SchemaConversionError(f"{path}: cannot make a union of {types} structural")
    if nullable:
        out["nullable"] = True
    return out


def _merge_objects(objects: list[Schema], path: str) -> Schema:
    """One object with every member's fields (a tagged union): enums of a shared field unite,
    ``required`` keeps what all members require; pydantic checks the member's own rules."""
    props: Schema = {}
    for obj in objects:
        for name, sub in obj.get("properties", {}).items():
            if name not in props:
                props[name] = copy.deepcopy(sub)
            elif "enum" in props[name] and "enum" in sub:
                props[name]["enum"] = list(dict.fromkeys([*props[name]["enum"], *sub["enum"]]))
            elif props[name].get("type") != sub.get("type"):
                raise SchemaConversionError(f"{path}.{name}: members disagree on its type")
    required = set.intersection(*(set(o.get("required", [])) for o in objects))
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = sorted(required)
    return out


def _preset_complete_models(root: type[BaseModel]) -> set[str]:
    """Names of the models under ``root`` that every ``preset`` value alone makes valid (a
    pydantic ``before`` validator fills their shape fields): the CRD must not require those
    fields, pydantic still does when no preset is given."""
    out: set[str] = set()
    for model in _models_under(root):
        field = model.model_fields.get("preset")
        if field is None:
            continue
        values = [v for arg in get_args(field.annotation) for v in get_args(arg)]
        if values and all(_valid(model, {"preset": v}) for v in values):
            out.add(model.__name__)
    return out


def _models_under(root: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo: list[Any] = [root]
    while todo:
        tp = todo.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                continue
            seen.append(tp)
            todo += [f.annotation for f in tp.model_fields.values()]
        else:
            todo += list(get_args(tp))
    return seen


def _valid(model: type[BaseModel], data: dict[str, Any]) -> bool:
    try:
        model.model_validate(data)
    except ValidationError:
        return False
    return True


def spec_schema() -> Schema:
    schema = OmniTrainingJobSpec.model_json_schema(by_alias=True)
    for name in _preset_complete_models(OmniTrainingJobSpec):
        schema["$defs"][name].pop("required", None)
    return structural(schema)


def status_schema() -> Schema:
    return structural(OmniTrainingJobStatus.model_json_schema(by_alias=True))


def crd() -> Schema:
    """The CRD object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": "OmniTrainingJob",
                "listKind": "OmniTrainingJobList",
                "plural": PLURAL,
                "singular": "omnitrainingjob",
                "shortNames": ["otj"],
                "categories": ["all", "omni"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A multimodal LLM training job (MegaScale-Omni).",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def _printer_columns() -> list[Schema]:
    def col(name: str, type_: str, path: str, **extra: Any) -> Schema:
        return {"name": name, "type": type_, "jsonPath": path, **extra}

    return [
        col("Phase", "string", ".status.phase"),
        col("Step", "integer", ".status.step"),
        col("Tokens/s", "integer", ".status.tokensPerSecond"),
        col("MFU", "string", ".status.mfuPercent"),
        col("Restarts", "integer", ".status.restarts"),
        col("Nodes", "integer", ".spec.nodes", priority=1),
        col("Age", "date", ".metadata.creationTimestamp"),
    ]


def render_yaml() -> str:
    header = (
        "# Generated by `make crds` (omni_operator.crd) from the pydantic models. Do not edit.\n"
    )
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def structural_violations(schema: Schema, path: str = "") -> list[str]:
    """Rules of structural schemas (k8s apiextensions) this generator must never break."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return [f"{path}: not a schema"]
    special = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-int-or-string"
    )
    if "type" not in schema and not special:
        out.append(f"{path or '<root>'}: no type")
    for key in ("$ref", "anyOf", "oneOf", "allOf", "not", "$defs", "definitions"):
        if key in schema:
            out.append(f"{path}: {key} present")
    if schema.get("additionalProperties") is False:
        out.append(f"{path}: additionalProperties: false")
    if "properties" in schema and "additionalProperties" in schema:
        out.append(f"{path}: properties and additionalProperties together")
    if schema.get("uniqueItems"):
        out.append(f"{path}: uniqueItems: true")
    if "default" in schema and schema["default"] is None:
        out.append(f"{path}: default null")
    for name, sub in schema.get("properties", {}).items():
        out += structural_violations(sub, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        out += structural_violations(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        out += structural_violations(schema["items"], f"{path}[]")
    return out


def to_jsonschema(schema: Schema) -> Schema:
    """The OpenAPI v3 dialect of a CRD as plain JSON Schema (nullable, int-or-string, exclusive
    bounds), to validate custom resources offline with ``jsonschema`` as the API server would."""
    out: Schema = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in {"items", "additionalProperties"} and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key in {"exclusiveMinimum", "exclusiveMaximum"}:
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            if value:
                out[key] = schema[bound]
        elif key.startswith("x-kubernetes-") or key == "nullable":
            continue
        else:
            out[key] = value
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if schema.get(exclusive):
            out.pop(bound, None)
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if schema.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # what the API server's strict field validation does
    return out


def write(directory: str | Path) -> Path:
    """Write the CRD YAML into ``directory``; returns the file."""
    path = Path(directory) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_yaml())
    return path


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else "crds"))
