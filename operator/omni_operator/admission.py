"""Admission: whether a job's new attempt starts now, waits in the queue, or cannot be placed.

A job is placed on free capacity (:mod:`omni_operator.capacity`: allocatable minus what every
other pod on the node holds, other jobs' and other workloads' included). A job that could run
on the cluster's nodes but not beside what runs there now creates no pods and waits in phase
``Queued``; the condition ``Queued`` says what it waits for. Jobs are served first come, first
served within a priority (the value of ``scheduling.priorityClassName``'s PriorityClass): a job
starts only when no queued job of a higher priority, or of the same priority and created
earlier, waits before it (no overtaking, so a large job is not starved by small ones). A job that
cannot fit even on empty nodes is not queued (phase ``Placing``) and holds nobody back. With
``scheduling.kueueQueue`` Kueue is the queue: the pods are created at once and Kueue admits them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from omni_operator import capacity
from omni_operator.placement import Placement, PlacementError, place, usable_nodes
from omni_operator.render import LABEL_JOB
from omni_operator.spec import OmniTrainingJob, OmniTrainingJobSpec

Obj = Mapping[str, Any]
JobKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Decision:
    """Place the job (``placement``), or wait: ``reason`` and ``message`` say for what."""

    placement: Placement | None
    reason: Literal["Placed", "Unschedulable", "InsufficientCapacity", "BehindInQueue"]
    message: str

    @property
    def queued(self) -> bool:
        return self.reason in ("InsufficientCapacity", "BehindInQueue")


def admit(
    nodes: Sequence[Obj],
    job: OmniTrainingJob,
    *,
    quarantined: Iterable[str] = (),
    cluster_pods: Sequence[Obj] | None = None,
    ahead: Sequence[JobKey] = (),
) -> Decision:
    """The decision for ``job``'s next attempt (see the module docstring).

    Args:
        nodes: the cluster's Nodes.
        job: the job.
        quarantined: nodes the job avoids.
        cluster_pods: every pod of the cluster (None: unknown; placed on allocatable alone).
        ahead: queued jobs served before this one (:func:`queue_ahead`).
    """
    spec = job.spec
    avoid = list(quarantined)
    try:
        anyway = place(nodes, spec, quarantined=avoid)
    except PlacementError as err:
        return Decision(None, "Unschedulable", str(err))
    if cluster_pods is None or spec.scheduling.kueue_queue:  # Kueue admits (omni_operator.kueue)
        return Decision(anyway, "Placed", "")
    if ahead:
        names = ", ".join(f"{ns}/{name}" for ns, name in ahead[:5])
        more = f" and {len(ahead) - 5} more" if len(ahead) > 5 else ""
        return Decision(None, "BehindInQueue",
                        f"behind {len(ahead)} job{'s' if len(ahead) > 1 else ''} queued earlier "
                        f"or at a higher priority: {names}{more}")  # fmt: skip
    others = [p for p in cluster_pods if not _owned(p, job)]
    free = capacity.free(nodes, others)
    try:
        return Decision(place(nodes, spec, quarantined=avoid, free=free), "Placed", "")
    except PlacementError as err:
        summary = waits_for(nodes, spec, quarantined=avoid, free=free)
        detail = "\n".join(str(err).splitlines()[1:])
        return Decision(None, "InsufficientCapacity", f"{summary}\n{detail}".rstrip())


def waits_for(
    nodes: Sequence[Obj],
    spec: OmniTrainingJobSpec,
    *,
    quarantined: Iterable[str],
    free: Mapping[str, Mapping[str, float]],
) -> str:
    """What a queued job waits for and how much of it is free now, e.g. ``2 nodes with 8 free
    GPUs in one domain; 1 now``."""
    scan = usable_nodes(nodes, spec, quarantined=quarantined, free=free)
    n, g = spec.nodes, spec.group_size
    groups = n // g
    g_ = spec.gpus_per_node
    what = f"{g_} free GPU{'s' if g_ > 1 else ''}" if g_ else "room for its pod (CPU, memory)"
    labelled = bool(spec.topology.network_domain_labels)
    if groups == 1:
        where = " in one domain" if labelled else ""
        now = max((len(v) for v in scan.usable.values()), default=0)
        return f"{n} node{'s' if n > 1 else ''} with {what}{where}; {now} now"
    fit = sum(len(v) // g for v in scan.usable.values())
    return (f"{groups} groups of {g} nodes with {what}, each group in one domain; "
            f"{fit} group{'s' if fit != 1 else ''} now")  # fmt: skip


def _owned(pod: Obj, job: OmniTrainingJob) -> bool:
    """A pod of ``job`` (its own pods never keep it from its nodes: they are the ones it
    replaces, and its new pods wait for them to go)."""
    meta = pod.get("metadata") or {}
    return (meta.get("labels") or {}).get(LABEL_JOB) == job.metadata.name and (
        meta.get("namespace") or "default"
    ) == (job.metadata.namespace or "default")


# -- the queue ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueEntry:
    key: JobKey
    priority: int
    created: str
    """``metadata.creationTimestamp`` (RFC 3339, so strings order as times)."""

    def order(self) -> tuple[int, str, JobKey]:
        return (-self.priority, self.created, self.key)


def priority_of(raw_job: Obj, priorities: Mapping[str, int], default: int = 0) -> int:
    """The value of the job's ``scheduling.priorityClassName`` (``default``: none named, or
    the class is unknown)."""
    name = ((raw_job.get("spec") or {}).get("scheduling") or {}).get("priorityClassName")
    return priorities.get(name, default) if name else default


def priority_values(classes: Iterable[Obj]) -> tuple[dict[str, int], int]:
    """PriorityClass objects -> (value by name, the global default's value or 0)."""
    values = {c["metadata"]["name"]: int(c.get("value") or 0) for c in classes}
    default = next((int(c.get("value") or 0) for c in classes if c.get("globalDefault")), 0)
    return values, default


def entry(raw_job: Obj, priorities: Mapping[str, int], default: int = 0) -> QueueEntry:
    meta = raw_job.get("metadata") or {}
    return QueueEntry(
        key=(meta.get("namespace") or "default", meta["name"]),
        priority=priority_of(raw_job, priorities, default),
        created=str(meta.get("creationTimestamp") or ""),
    )


def queue_ahead(raw_job: Obj, raw_jobs: Iterable[Obj], classes: Iterable[Obj] = ()) -> list[JobKey]:
    """The queued jobs (phase ``Queued``) served before ``raw_job``, in queue order."""
    classes = list(classes)
    values, default = priority_values(classes)
    me = entry(raw_job, values, default)
    waiting = [
        entry(j, values, default)
        for j in raw_jobs
        if (j.get("status") or {}).get("phase") == "Queued"
        and not (j.get("metadata") or {}).get("deletionTimestamp")
    ]
    return [e.key for e in sorted(waiting, key=QueueEntry.order)
            if e.key != me.key and e.order() < me.order()]  # fmt: skip


def was_queued(conditions: Sequence[Any]) -> bool:
    """The job's condition ``Queued`` is True (it waited and now starts)."""
    return any(c.type == "Queued" and c.status == "True" for c in conditions)
