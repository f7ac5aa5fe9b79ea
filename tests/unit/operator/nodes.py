"""Hand-made Node objects for placement and rendering tests."""

from __future__ import annotations

from typing import Any

ZONE = "topology.kubernetes.io/zone"
SPINE = "omni.megascale.io/spine"


def node(
    name: str,
    *,
    zone: str | None = "z1",
    spine: str | None = "a",
    gpus: int = 8,
    ready: bool | None = True,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
    rdma: int | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as the API returns it, with only the fields placement reads."""
    all_labels = {"kubernetes.io/hostname": name, **(labels or {})}
    if zone is not None:
        all_labels[ZONE] = zone
    if spine is not None:
        all_labels[SPINE] = spine
    allocatable = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": str(gpus)}
    if rdma is not None:
        allocatable["rdma/ib"] = str(rdma)
    conditions = [] if ready is None else [{"type": "Ready", "status": str(ready)}]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"taints": taints or [], **({"unschedulable": True} if unschedulable else {})},
        "status": {"allocatable": allocatable, "capacity": allocatable, "conditions": conditions},
    }


def cluster(layout: dict[tuple[str, str], int], *, start: int = 0) -> list[dict[str, Any]]:
    """Nodes n<i> numbered across domains in the given order: {(zone, spine): count}."""
    out, i = [], start
    for (zone, spine), count in layout.items():
        for _ in range(count):
            out.append(node(f"n{i}", zone=zone, spine=spine))
            i += 1
    return out
