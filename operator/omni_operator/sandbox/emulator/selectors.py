"""Label and field selectors as the API server reads them (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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


def _field(obj: Mapping[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    return cur


def matches_fields(selector: str | None, obj: Mapping[str, Any]) -> bool:
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
