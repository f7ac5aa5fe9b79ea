"""The sandbox's scheduler: binds each pending pod to a node, as kube-scheduler does.

A pending pod is bound (``spec.nodeName``) to the node its required node affinity or
``nodeSelector`` names, if that node is Ready and its allocatable, less the requests of the pods
bound to it (:mod:`omni_operator.capacity`: GPUs, CPU, memory...), holds the pod's requests; else
it stays Pending, PodScheduled=False reason Unschedulable, as kube-scheduler leaves it (reason
SchedulingGated while it carries a scheduling gate). A pod that names no node (a Deployment's, a
job's of ``scheduling.placement: scheduler``) goes to the least allocated Ready node that holds
its requests and passes its node and inter-pod constraints (the filters of
:mod:`omni_operator.sandbox.scheduling`; kube-scheduler's default scoring, simplified).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_operator import capacity
from omni_operator.capacity import pinned_node
from omni_operator.kube_objects import node_not_ready_since
from omni_operator.sandbox import scheduling
from omni_operator.sandbox.kubelet.api import ApiClient, now_iso, pod_key, pod_path
from omni_operator.sandbox.kubelet.node import SimNode, find_node

Obj = dict[str, Any]
GATED_MESSAGE = "Scheduling is blocked due to non-empty scheduling gates"
"""kube-scheduler's PodScheduled message for a pod with scheduling gates."""


@dataclass
class Scheduler:
    """Binds the pending pods of one tick to the emulated :attr:`nodes`."""

    client: ApiClient
    nodes: list[SimNode]
    held: dict[str, capacity.Resources] = field(default_factory=dict)
    """What the pods bound to each node request (this tick's bindings included)."""
    bound: list[Obj] = field(default_factory=list)
    """The pods bound to a node (this tick's bindings included): inter-pod constraints."""
    unschedulable: dict[str, str] = field(default_factory=dict)
    """Pending pods' PodScheduled reason as last reported (Unschedulable, SchedulingGated)."""

    def observe(self, pods: list[Obj]) -> None:
        """Start a tick from the pods the API server lists."""
        self.bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
        self.held = capacity.used(self.bound)

    def free(self, node: Obj) -> capacity.Resources:
        """The node's allocatable less what the pods bound to it request."""
        (left,) = capacity.free([node], []).values()
        for k, v in self.held.get(node["metadata"]["name"], {}).items():
            left[k] = left.get(k, 0.0) - v
        return left

    def pick(self, pod: Obj, nodes: Mapping[str, Obj]) -> str | None:
        """A node for a pod that names none: among the Ready nodes that pass its constraints
        (:func:`omni_operator.sandbox.scheduling.feasible`), the one least allocated
        (kube-scheduler's default scoring), the first by name on a tie."""
        now = dt.datetime.now(tz=dt.UTC)
        labels = scheduling.labels_by_node(nodes.values())
        fits = []
        for sim in self.nodes:
            node = nodes.get(sim.name)
            if node is None or sim.lost:
                continue
            free = self.free(node)
            if not scheduling.feasible(pod, node, pods=self.bound, free=free, labels=labels,
                                       now=now):  # fmt: skip
                continue
            held = self.held.get(sim.name, {})
            alloc = capacity.resources((node.get("status") or {}).get("allocatable") or {})
            used = sum(held.get(k, 0.0) / alloc[k] for k in ("cpu", "memory") if alloc.get(k))
            fits.append((used, sim.index, sim.name))
        return min(fits)[2] if fits else None

    async def schedule(self, pod: Obj, nodes: Mapping[str, Obj]) -> None:
        """Bind the pod, or report why it stays Pending (once per reason)."""
        key = pod_key(pod)
        name = pinned_node(pod) or self.pick(pod, nodes)
        sim = find_node(self.nodes, name) if name else None
        want = capacity.pod_requests(pod)
        reason, why = self._unbindable(pod, name, sim, nodes, want)
        if why is not None:
            if self.unschedulable.get(key) != reason:
                self.unschedulable[key] = reason
                cond = {"type": "PodScheduled", "status": "False", "reason": reason,
                        "message": why, "lastTransitionTime": now_iso()}  # fmt: skip
                await self.client.patch(pod_path(pod, "status"), {"status": {"phase": "Pending",
                                        "conditions": [cond]}})  # fmt: skip
            return
        assert sim is not None
        self.unschedulable.pop(key, None)
        held = self.held.setdefault(sim.name, {})  # later pods of this tick see this one
        for k, v in want.items():
            held[k] = held.get(k, 0.0) + v
        await self.client.patch(pod_path(pod), {"spec": {"nodeName": name}})
        self.bound.append({**pod, "spec": {**(pod.get("spec") or {}), "nodeName": name}})

    def _unbindable(
        self,
        pod: Obj,
        name: str | None,
        sim: SimNode | None,
        nodes: Mapping[str, Obj],
        want: capacity.Resources,
    ) -> tuple[str, str | None]:
        """(PodScheduled reason, why the pod cannot go to node ``name``; None: it can)."""
        if (pod.get("spec") or {}).get("schedulingGates"):
            return "SchedulingGated", GATED_MESSAGE
        if sim is None:
            return "Unschedulable", (
                f"node {name!r} is not a sandbox node"
                if name
                else f"0/{len(self.nodes)} nodes are available: none is Ready with room for "
                "the pod's requests and the labels of its nodeSelector"
            )
        if (
            sim.lost
            or name not in nodes
            or node_not_ready_since(nodes[name], dt.datetime.now(tz=dt.UTC)) is not None
        ):
            return "Unschedulable", f"node {name} is not Ready"
        short = capacity.shortfall(want, self.free(nodes[name]))
        return "Unschedulable", f"node {name}: insufficient resources ({short})" if short else None
