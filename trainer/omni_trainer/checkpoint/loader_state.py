"""Loader state: captured in memory at a step boundary, serialized and stored in the background.

The data stream's ``state_dict()`` is JSON-safe (cursors, mixture counters, packing buffer as
sample keys, RNG state). Writing it synchronously costs the training loop serialization plus
storage latency (minutes at scale, per the paper); here the loop pays only :func:`snapshot`, a
copy of the containers that shares immutable leaves, and a background thread does the rest.
"""

from __future__ import annotations

import json
from typing import Any

_ATOMS = frozenset({int, float, str, bool, type(None), bytes})
SHARED = "shared"
PER_RANK = "per_rank"


def snapshot(obj: Any) -> Any:
    """A copy of a JSON-like state that later mutation of ``obj`` cannot reach.

    Immutable leaves (numbers, strings) are shared, flat lists of them are copied by one C-level
    ``list()``, numpy arrays and tensors by one memcpy: copying is about memory bandwidth, not
    per-element Python, which is what makes the capture cheap enough for every checkpoint.
    """
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind is dict:
        return {k: snapshot(v) for k, v in obj.items()}
    if kind is list or kind is tuple:
        if set(map(type, obj)) <= _ATOMS:
            return list(obj)
        return [snapshot(v) for v in obj]
    copy = getattr(obj, "copy", None) or getattr(obj, "clone", None)  # numpy / torch
    if copy is None:
        raise TypeError(f"loader state holds a {kind.__name__}, which snapshot cannot copy")
    return copy()


def loader_file(rank: int) -> str:
    """The file of ``rank``'s loader state inside a step directory."""
    return f"loader/rank-{rank:05d}.json"


def serialize(state: Any) -> bytes:
    """JSON bytes of a snapshot (floats round-trip exactly through ``json``).

    Long lists are encoded in slices: ``json.dumps`` runs in C without releasing the GIL, so one
    call on a 100 MB list would stall the training loop's thread for a second; between slices
    the interpreter can switch back to it.
    """
    return "".join(_encode(state)).encode()


def _encode(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        parts = ["{"]
        for i, (key, value) in enumerate(obj.items()):
            parts.append(("," if i else "") + json.dumps(str(key)) + ":")
            parts.extend(_encode(value))
        parts.append("}")
        return parts
    if isinstance(obj, list | tuple) and len(obj) > _SLICE:
        pieces = [_dumps(obj[i : i + _SLICE])[1:-1] for i in range(0, len(obj), _SLICE)]
        return ["[", ",".join(pieces), "]"]
    return [_dumps(obj)]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=_array_to_list)


_SLICE = 16384


def deserialize(data: bytes) -> Any:
    """The state written by :func:`serialize`."""
    return json.loads(data)


def _array_to_list(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)
    if tolist is None:
        raise TypeError(f"{type(obj).__name__} is not JSON-serializable")
    return tolist()


def file_for(rank: int, scope: str) -> str:
    """Which file ``rank`` reads back: its own (per-rank states) or rank 0's (shared)."""
    return loader_file(rank if scope == PER_RANK else 0)
