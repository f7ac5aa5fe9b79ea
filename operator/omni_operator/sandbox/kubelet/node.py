"""The sandbox's emulated nodes as the kubelet keeps them, and the Ready condition it posts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omni_operator.sandbox.kubelet.api import now_iso

GPU = "nvidia.com/gpu"
"""The extended resource an emulated node advertises its GPUs as."""


@dataclass
class SimNode:
    name: str
    index: int
    gpus: int
    lost: bool = False
    degraded: asyncio.Task | None = None
    """The ``degraded-network`` fault's duty cycle on its pods (``sandbox.degrade``)."""
    pulled: dict[str, float] = field(default_factory=dict)
    """Its image cache: image reference -> the loop time its pull ends (started on first use)."""


def find_node(nodes: Iterable[SimNode], name: str | None) -> SimNode | None:
    """The emulated node named ``name`` (None: not one of them)."""
    return next((n for n in nodes if n.name == name), None)


def ready_condition(ready: bool) -> list[dict[str, Any]]:
    """A node's conditions as its kubelet posts them: Ready, or Unknown once it is lost."""
    return [
        {
            "type": "Ready",
            "status": "True" if ready else "Unknown",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "message": "sandbox kubelet is posting ready status"
            if ready
            else "Kubelet stopped posting node status (sandbox fault: lost)",
            "lastHeartbeatTime": now_iso(),
            "lastTransitionTime": now_iso(),
        }
    ]
