"""Kueue as the admission path (``scheduling.kueueQueue``): what its pod integration does to the
job's pods, read from the pods alone (pure functions).

Kueue's contract for plain pods (kueue.sigs.k8s.io, "Run Plain Pods"; its pod controller):

* at creation its webhook adds the scheduling gate :data:`GATE` to every pod labelled with
  :data:`QUEUE_LABEL`; kube-scheduler leaves a gated pod alone and reports ``PodScheduled=False``
  reason ``SchedulingGated``. The pods of one ``kueue.x-k8s.io/pod-group-name`` form one Workload,
  admitted when the ClusterQueue's quota fits all ``pod-group-total-count`` of them; admission
  removes the gate from each (then the scheduler binds them);
* to stop an admitted Workload (preemption by a higher priority, eviction) Kueue marks each pod
  with a condition (``DisruptionTarget`` in current releases, ``TerminationTarget`` in older ones)
  whose reason says why (``Preempted``, ``EvictedByKueue``, ``WorkloadEvicted``...) and deletes it
  with its grace period.

A gated attempt is queued, not starting: its start deadline counts from admission. A preempted
attempt is stopped gracefully (the trainers' emergency checkpoint within the grace), is no
failure (the restart budget is untouched) and waits queued for a new admission.

With ``scheduling.topologyAware``, the pods also carry Kueue's Topology-Aware Scheduling (TAS)
request derived from the layout (:func:`topology_annotations`, "Run Workloads with
Topology-Aware Scheduling"); Kueue then chooses the nodes, so the pods are not pinned: a pod
group whose pods differ in node affinity would be split into one PodSet per pod, and a slice
larger than its PodSet is invalid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_operator.spec import OmniTrainingJobSpec

Obj = Mapping[str, Any]

GATE = "kueue.x-k8s.io/admission"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
GROUP_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
POD_INDEX_LABEL = "kueue.x-k8s.io/pod-group-pod-index"
"""A pod's index in its group: TAS assigns consecutive indices to consecutive places in the
chosen domains, so pods numbered by node rank keep each slice on consecutive ranks."""
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
SLICE_TOPOLOGY = "kueue.x-k8s.io/podset-slice-required-topology"
SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size"
STOP_CONDITIONS = ("DisruptionTarget", "TerminationTarget")
KUEUE_REASONS = frozenset({
    "Preempted", "EvictedByKueue", "WorkloadEvicted", "InClusterQueue", "InCohortReclamation",
    "InCohortFairSharing", "InCohortReclaimWhileBorrowing", "EvictedDueToPodsReadyTimeout",
    "EvictedDueToAdmissionCheck", "EvictedDueToClusterQueueStopped", "NotAdmitted",
})  # fmt: skip
"""Reasons of Kueue's stop conditions (its eviction and preemption reasons)."""


def gated(pod: Obj) -> bool:
    """The pod still carries Kueue's scheduling gate (not admitted yet)."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == GATE for g in gates)


@dataclass(frozen=True)
class Waiting:
    """An attempt whose pods Kueue has not admitted."""

    gated: int
    reason: str
    """The pods' PodScheduled reason (``SchedulingGated``)."""
    message: str

    def describe(self, queue: str, total: int) -> str:
        return (f"{self.gated} of {total} pods gated by Kueue (LocalQueue {queue}): "
                f"{self.reason}{': ' + self.message if self.message else ''}")  # fmt: skip


def waiting(pods: Sequence[Obj]) -> Waiting | None:
    """The attempt waits for Kueue's admission (any pod gated), or None."""
    held = [p for p in pods if gated(p)]
    if not held:
        return None
    conditions = [c for p in held for c in (p.get("status") or {}).get("conditions") or []]
    cond = next(
        (c for c in conditions if c.get("type") == "PodScheduled" and c.get("status") == "False"),
        {},
    )
    return Waiting(len(held), cond.get("reason") or "SchedulingGated", cond.get("message") or "")


@dataclass(frozen=True)
class Eviction:
    """Kueue stopped the attempt's pods."""

    pods: tuple[str, ...]
    reason: str
    message: str

    def describe(self) -> str:
        return (f"Kueue stopped {', '.join(self.pods)}: {self.reason}"
                f"{': ' + self.message if self.message else ''}")  # fmt: skip


def evicted(pods: Sequence[Obj]) -> Eviction | None:
    """The attempt's pods Kueue marked for termination (see the module docstring), or None."""
    hit: list[tuple[str, Obj]] = []
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if (c.get("type") in STOP_CONDITIONS and c.get("status") == "True"
                    and c.get("reason") in KUEUE_REASONS):  # fmt: skip
                hit.append((pod["metadata"]["name"], c))
                break
    if not hit:
        return None
    first = hit[0][1]
    return Eviction(tuple(sorted(n for n, _ in hit)), first["reason"], first.get("message") or "")


def topology_annotations(spec: OmniTrainingJobSpec) -> dict[str, str]:
    """Kueue's TAS request for the job's pod group, the constraints placement keeps itself.

    A reorder group (``topology.reorderGroupSize`` consecutive node ranks) must lie inside one
    domain of the finest ``topology.networkDomainLabels`` level, the level whose values all its
    nodes share. When one group is the whole job that is the PodSet's required topology; else
    each group is a PodSet slice required at that level, and the whole job prefers that level,
    which Kueue relaxes one level up at a time as placement widens its choice when no domain
    holds everything. Tensor and encoder sequence-parallel groups never leave a node (one pod),
    so they need no constraint. Kueue takes a slice to be consecutive pod indices
    (:data:`POD_INDEX_LABEL`), as reorder groups are consecutive node ranks.

    Args:
        spec: a validated spec with ``topology.networkDomainLabels`` set.

    Returns:
        The annotations every pod of the group carries.
    """
    level = spec.topology.network_domain_labels[-1]
    if spec.group_size == spec.nodes:
        return {REQUIRED_TOPOLOGY: level}
    return {PREFERRED_TOPOLOGY: level, SLICE_TOPOLOGY: level, SLICE_SIZE: str(spec.group_size)}
