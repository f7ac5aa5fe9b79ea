"""What the emulated API server checks on a write before it stores it (pure): a name that is a
DNS-1123 subdomain, an object its CRD's schema admits, a nesting depth it can copy."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

Obj = dict[str, Any]
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
MAX_DEPTH = 100
"""The deepest object a write may carry (copies and merges of deeper ones recurse too far)."""


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


def _strip_status(schema: Obj) -> Obj:
    """The schema without ``status`` and ``metadata`` (written through /status, checked apart)."""
    props = {k: v for k, v in (schema.get("properties") or {}).items()
             if k not in ("status", "metadata")}  # fmt: skip
    return {**schema, "properties": props}


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
