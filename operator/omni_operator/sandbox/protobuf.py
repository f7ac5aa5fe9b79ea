"""Kubernetes' protobuf encoding of Secrets, ConfigMaps and Namespaces, read into their JSON.

client-go's typed clients write built-in kinds as protobuf (Helm stores its releases in Secrets
so; ``kubectl create secret|configmap|namespace`` too) and do not retry in JSON. The sandbox's
API server reads JSON, so these kinds are decoded here: the envelope (``k8s\\0`` +
``runtime.Unknown``) and the fields of ``core/v1`` ``Secret``, ``ConfigMap`` (a Namespace: its
metadata) and their ``ObjectMeta`` that clients set on a write (field numbers from
``k8s.io/api/core/v1/generated.proto`` and ``k8s.io/apimachinery/pkg/apis/meta/v1/
generated.proto``). Any other kind is refused (None).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

Obj = dict[str, Any]
MAGIC = b"k8s\x00"


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a message: an int (varint) or bytes (length-delimited);
    fixed-width fields are skipped (none of the fields read here are)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            size, i = _varint(buf, i)
            yield number, buf[i : i + size]
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf: unsupported wire type {wire}")


def _entry(buf: bytes) -> tuple[str, bytes]:
    """A map entry: key (1), value (2)."""
    key, value = "", b""
    for number, v in fields(buf):
        if number == 1 and isinstance(v, bytes):
            key = v.decode()
        elif number == 2 and isinstance(v, bytes):
            value = v
    return key, value


_META_STRINGS = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}


def object_meta(buf: bytes) -> Obj:
    """The ``ObjectMeta`` a client writes: names, labels, annotations, finalizers."""
    meta: Obj = {}
    for number, v in fields(buf):
        if not isinstance(v, bytes):
            continue
        if number in _META_STRINGS and v:
            meta[_META_STRINGS[number]] = v.decode()
        elif number in (11, 12):
            key, value = _entry(v)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = value.decode()
        elif number == 14:
            meta.setdefault("finalizers", []).append(v.decode())
    return meta


def decode(body: bytes) -> Obj | None:
    """The JSON object of a protobuf-encoded Secret, ConfigMap or Namespace (its metadata;
    None: another kind)."""
    if not body.startswith(MAGIC):
        return None
    api_version = kind = ""
    raw = b""
    for number, v in fields(body[len(MAGIC) :]):
        if number == 1 and isinstance(v, bytes):
            for n, tv in fields(v):
                if n == 1 and isinstance(tv, bytes):
                    api_version = tv.decode()
                elif n == 2 and isinstance(tv, bytes):
                    kind = tv.decode()
        elif number == 2 and isinstance(v, bytes):
            raw = v
    if api_version != "v1" or kind not in ("Secret", "ConfigMap", "Namespace"):
        return None
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": {}}
    for number, v in fields(raw):
        if number == 1 and isinstance(v, bytes):
            obj["metadata"] = object_meta(v)
        elif kind == "Secret" and number == 2 and isinstance(v, bytes):
            key, value = _entry(v)
            obj.setdefault("data", {})[key] = base64.b64encode(value).decode()
        elif kind == "Secret" and number == 3 and isinstance(v, bytes):
            obj["type"] = v.decode()
        elif kind == "Secret" and number == 4 and isinstance(v, bytes):
            key, value = _entry(v)
            obj.setdefault("stringData", {})[key] = value.decode()
        elif kind == "ConfigMap" and number == 2 and isinstance(v, bytes):
            key, value = _entry(v)
            obj.setdefault("data", {})[key] = value.decode()
        elif kind == "ConfigMap" and number == 3 and isinstance(v, bytes):
            key, value = _entry(v)
            obj.setdefault("binaryData", {})[key] = base64.b64encode(value).decode()
        elif number == (5 if kind == "Secret" else 4) and isinstance(v, int):
            obj["immutable"] = bool(v)
    return obj
