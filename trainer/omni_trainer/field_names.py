"""The manifest fields known at a place in the model tree, for "did you mean" on a field that
is not one (torch-free: the operator's validation uses it too)."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_camel


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _field(model: type[BaseModel], key: str) -> Any | None:
    for name, info in model.model_fields.items():
        if key in (name, info.alias, to_camel(name)):
            return info
    return None


def _is_tag(model: type[BaseModel], key: str) -> bool:
    """``key`` is the tag pydantic puts in the location of a tagged union's member (its kind)."""
    kind = model.model_fields.get("kind")
    return kind is not None and key in typing.get_args(kind.annotation)


def known_fields(root: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """The camelCase fields the model at ``loc[:-1]`` accepts (empty: the place is unknown)."""
    models = [root]
    for key in loc[:-1]:
        if isinstance(key, int):
            continue
        tagged = [m for m in models if _is_tag(m, key)]
        if tagged:
            models = tagged
            continue
        found = [f for m in models if (f := _field(m, key)) is not None]
        models = [m for f in found for m in _models_in(f.annotation)]
        if not models:
            return []
    return sorted({info.alias or to_camel(name) for m in models
                   for name, info in m.model_fields.items()})  # fmt: skip


def did_you_mean(root: type[BaseModel], loc: Sequence[str | int]) -> str | None:
    """The known field closest to the unknown one at ``loc`` (None: none is close)."""
    if not loc or not isinstance(loc[-1], str):
        return None
    close = difflib.get_close_matches(loc[-1], known_fields(root, loc), n=1, cutoff=0.6)
    return close[0] if close else None
