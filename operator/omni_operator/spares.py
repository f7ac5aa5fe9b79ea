"""Hot spares (``spec.spareNodes``): standby pods, their refill, and a lost node's rank moving
to one of them (pure functions over plain dicts).

A spare is a pod of the gang's attempt labelled ``spare=standby``: scheduled on a free node of
the job's network domains, image pulled, its supervisor started with ``--standby`` (it warms
the trainer's imports and waits). When a node is lost and a ready spare runs in that node's
domain, :func:`plan_swap` gives the lost rank to it: the operator relabels the spare
(``spare=assigned``, the rank's label and placed-node annotation, so it is one of the gang's
pods from then on), writes the rank's environment into the order its supervisor watches (the
job's ConfigMap, :func:`assignments`), and the surviving pods restart in place with it. No pod
is created, scheduled or pulled on the way; :func:`refill` schedules a new standby afterwards,
while the job trains.

Why the ConfigMap order and not, say, a per-pod annotation read through the downward API: the
supervisors already watch that one file for in-place restarts, so the new rank and the restart
reach every pod in one write, atomically, and the same order keeps telling the spare its rank
at every later in-place restart. Node rank 0 is taken over too: it hosts the static
rendezvous, whose address (``MASTER_ADDR``) is the attempt's rendezvous Service, selecting the
pod labelled node rank 0; the relabelled spare is that pod once the lost one is deleted, and the
survivors' torchrun resolves it when it starts.

With ``scheduling.placement: scheduler`` a standby names no node: it requires one of the gang's
network domains and a node without another pod of the gang, and the scheduler binds it. The
gang's own pods get their ranks through the same order (:func:`assignments`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_operator.kube_objects import node_not_ready_since, pod_node, pod_rank
from omni_operator.placement import node_domain, place_rank, place_spares
from omni_operator.recovery.failures import Failure
from omni_operator.render import (
    ANNOTATION_NODE,
    LABEL_PLACEMENT,
    LABEL_RANK,
    LABEL_SPARE,
    SCHEDULER,
    SPARE_RANK,
    by_scheduler,
    render_pod,
    spare_env,
    spare_pod_name,
)
from omni_operator.spec import OmniTrainingJob
from omni_operator.status import SpareStatus

Obj = dict[str, Any]
STANDBY = "standby"
ASSIGNED = "assigned"


def _labels(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def is_standby(pod: Mapping[str, Any]) -> bool:
    return _labels(pod).get(LABEL_SPARE) == STANDBY


def replaced(pod: Mapping[str, Any], placement: Sequence[str]) -> bool:
    """A gang pod whose rank moved to a spare (placement names another node for its rank)."""
    rank, node = pod_rank(pod), pod_node(pod)
    if rank is None or node is None or rank >= len(placement):
        return False
    return placement[rank] != node


def ready(pod: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]],
          now: dt.datetime) -> bool:  # fmt: skip
    """The standby can take a rank over: running on a Ready node, not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    node = pod_node(pod)
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    running = any((cs.get("state") or {}).get("running") is not None
                  for cs in status.get("containerStatuses") or [])  # fmt: skip
    return running and node in nodes and node_not_ready_since(nodes[node], now) is None


def statuses(standby: Sequence[Mapping[str, Any]], nodes: Mapping[str, Mapping[str, Any]],
             now: dt.datetime) -> list[SpareStatus]:  # fmt: skip
    """``status.spares``: every standby pod, by name."""
    out = [
        SpareStatus(pod=p["metadata"]["name"], node=pod_node(p), ready=ready(p, nodes, now))
        for p in standby
    ]
    return sorted(out, key=lambda x: x.pod)


@dataclass(frozen=True)
class Refill:
    create: tuple[Obj, ...] = ()
    delete: tuple[Obj, ...] = ()
    """Standbys on lost nodes, failed ones, and those beyond ``spec.spareNodes``."""


def refill(
    job: OmniTrainingJob,
    *,
    standby: Sequence[Obj],
    gang_nodes: Sequence[str],
    nodes: Sequence[Mapping[str, Any]],
    pods_of: int,
    taken_names: Sequence[str],
    quarantined: Sequence[str] = (),
    now: dt.datetime,
) -> Refill:
    """Keep ``spec.spareNodes`` standby pods: drop the dead or surplus ones, create the missing
    ones on free nodes of the gang's network domains (fewer when no such node is free: the
    job trains on, and ``status.spares`` shows how many there are).

    Args:
        job: the job.
        standby: its standby pods now.
        gang_nodes: the nodes of the gang's pods (by rank).
        nodes: every Node.
        pods_of: the attempt whose pods the trainers run in (the standbys join that gang).
        taken_names: every pod name of the job (a new spare's name is not reused).
        quarantined: nodes to avoid.
        now: the observation time.
    """
    by_name = {str(n["metadata"]["name"]): n for n in nodes}
    drop, keep = [], []
    for pod in sorted(standby, key=lambda p: str(p["metadata"]["name"])):
        node = pod_node(pod)
        gone = node is not None and (
            node not in by_name or node_not_ready_since(by_name[node], now) is not None
        )
        phase = (pod.get("status") or {}).get("phase")
        deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
        if gone or phase in ("Failed", "Succeeded") or len(keep) >= job.spec.spare_nodes:
            drop.append(pod)
        elif not deleting:
            keep.append(pod)
    missing = job.spec.spare_nodes - len(keep)
    if missing <= 0:
        return Refill(delete=tuple(drop))
    labels = tuple(job.spec.topology.network_domain_labels)
    domains = {node_domain(by_name.get(n), labels) for n in gang_nodes} - {None}
    taken = set(gang_nodes) | {pod_node(p) for p in standby}
    if by_scheduler(job):  # the scheduler binds them, inside the domains their affinity names
        model = by_name.get(next(iter(gang_nodes), ""), {"metadata": {"name": ""}})
        chosen = [model] * missing if domains or not labels else []
    else:
        chosen = place_spares(nodes, job.spec, want=missing, domains=domains,
                              taken=taken - {None}, quarantined=quarantined)  # fmt: skip
    used, index, create = set(taken_names), 0, []
    for node in chosen:
        while spare_pod_name(job.metadata.name, index) in used:
            index += 1
        name = spare_pod_name(job.metadata.name, index)
        used.add(name)
        placed = place_rank(job.spec, SPARE_RANK, node)
        create.append(render_pod(job, placed, attempt=pods_of, spare=name,
                                 quarantined=quarantined, domains=sorted(domains)))  # fmt: skip
    return Refill(create=tuple(create), delete=tuple(drop))


@dataclass(frozen=True)
class Swap:
    """Lost node ranks and the standby pods that take them over."""

    ranks: Mapping[int, Obj]
    lost: tuple[Obj, ...]
    """The gang's pods on the lost nodes (replaced)."""


def plan_swap(
    failure: Failure,
    pods: Sequence[Obj],
    standby: Sequence[Obj],
    nodes: Mapping[str, Mapping[str, Any]],
    *,
    job: OmniTrainingJob,
    now: dt.datetime,
) -> Swap | None:
    """The spares that take the lost nodes' ranks over, or None (recreate the gang): when the
    failure is not a lost node, a surviving pod is not running, or a lost rank has no ready
    standby in its network domain. Node rank 0 moves like any other: the rendezvous Service
    selects whichever pod carries its label."""
    spec = job.spec
    if failure.kind != "node_lost" or not standby or len(pods) != spec.nodes:
        return None
    lost = [p for p in pods if pod_node(p) in failure.nodes]
    ranks = [pod_rank(p) for p in lost]
    if not lost or None in ranks:
        return None
    for pod in pods:
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        if pod not in lost and (status.get("phase") != "Running"
                                or meta.get("deletionTimestamp")):  # fmt: skip
            return None
    labels = tuple(spec.topology.network_domain_labels)

    def domain(node: str | None) -> tuple[str, ...] | None:
        return () if not labels else node_domain(nodes.get(node or ""), labels)

    free = sorted((p for p in standby if ready(p, nodes, now)),
                  key=lambda p: str(p["metadata"]["name"]))  # fmt: skip
    out: dict[int, Obj] = {}
    for pod, rank in sorted(zip(lost, ranks, strict=True), key=lambda x: x[1]):
        want = domain(pod_node(pod))
        match = next((s for s in free if want is not None and domain(pod_node(s)) == want), None)
        if match is None:
            return None
        free.remove(match)
        out[int(rank)] = match
    return Swap(ranks=out, lost=tuple(lost))


def relabel(spare: Obj, rank: int) -> Obj:
    """The merge patch that makes a standby the gang's pod of ``rank``."""
    meta = spare["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "labels": {LABEL_SPARE: ASSIGNED, LABEL_RANK: str(rank)},
            "annotations": {ANNOTATION_NODE: pod_node(spare)},
        },
    }


def assignments(job: OmniTrainingJob, pods: Sequence[Obj]) -> dict[str, dict[str, str]]:
    """The order's rank map: every pod of the gang given its rank after it started (an assigned
    spare, a pod the scheduler placed) and its rank's environment."""
    out = {}
    for pod in pods:
        rank, labels = pod_rank(pod), _labels(pod)
        later = labels.get(LABEL_SPARE) == ASSIGNED or labels.get(LABEL_PLACEMENT) == SCHEDULER
        if later and rank is not None:
            node = {"metadata": {"name": pod_node(pod) or ""}}
            out[str(pod["metadata"]["name"])] = spare_env(job, place_rank(job.spec, rank, node))
    return out
