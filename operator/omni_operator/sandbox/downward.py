"""``downwardAPI`` volumes as a kubelet writes them: a pod's own metadata as files.

A kubelet rewrites them (like ConfigMap volumes) when it syncs the pod: on an update of the pod
(its labels or annotations changed), a container starting or ending, and every
``syncFrequency`` (one minute) otherwise. The sandbox's kubelet does the same
(``Volumes.sync_s``, :mod:`omni_operator.sandbox.kubelet.volumes`), so an operator that writes
a ConfigMap and expects running pods to see it at once is caught as a real cluster would catch
it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_KEYED = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_PLAIN = ("name", "namespace", "uid")


def field_value(field_path: str, meta: Mapping[str, Any]) -> str:
    """One ``fieldRef.fieldPath`` of a downwardAPI volume item, as the kubelet renders it: a
    missing label or annotation is an empty file; a whole map is ``key="value"`` lines, sorted.

    Raises:
        ValueError: a field path a downwardAPI volume cannot project.
    """
    keyed = _KEYED.match(field_path)
    if keyed:
        return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
    section, _, name = field_path.partition(".")
    if section == "metadata" and name in ("labels", "annotations"):
        items = sorted((meta.get(name) or {}).items())
        return "\n".join(f"{k}={json.dumps(str(v), ensure_ascii=False)}" for k, v in items)
    if section == "metadata" and name in _PLAIN:
        return str(meta.get(name, ""))
    raise ValueError(
        f"downwardAPI volume: fieldRef {field_path!r} is not supported; use metadata.name, "
        "metadata.namespace, metadata.uid, metadata.labels or metadata.annotations (['key'])"
    )


def downward_files(volume: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, bytes]:
    """A ``downwardAPI`` volume's files (path -> content) for a pod with metadata ``meta``.

    Raises:
        ValueError: an item without a ``fieldRef`` (``resourceFieldRef`` is not emulated) or
            with a field path that cannot be projected.
    """
    out = {}
    for item in volume.get("items") or ():
        ref = item.get("fieldRef")
        if ref is None:
            raise ValueError(
                f"downwardAPI volume item {item.get('path')!r}: only fieldRef items are emulated"
            )
        out[str(item["path"])] = field_value(str(ref["fieldPath"]), meta).encode()
    return out


def metadata_version(meta: Mapping[str, Any]) -> str:
    """What a pod update that makes the kubelet sync it changes (labels, annotations)."""
    return json.dumps([meta.get("labels") or {}, meta.get("annotations") or {}], sort_keys=True)
