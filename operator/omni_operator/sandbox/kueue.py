"""An emulation of Kueue's pod integration for the sandbox (not Kueue itself): its documented
contract for plain pods, enough to run a job through Kueue's admission path on one machine.

* Webhook (:func:`gate`, the API emulator's ``before_create``): a pod labelled
  ``kueue.x-k8s.io/queue-name`` is created with the scheduling gate ``kueue.x-k8s.io/admission``
  (the sandbox's scheduler then leaves it Pending, ``PodScheduled=False`` reason
  ``SchedulingGated``, as kube-scheduler does).
* Admission (:class:`KueueEmulator`): the pods of one ``kueue.x-k8s.io/pod-group-name`` (or a
  pod alone) form a Workload, complete once ``kueue.x-k8s.io/pod-group-total-count`` pods exist.
  Its LocalQueue (``kueue.x-k8s.io/v1beta1`` ``localqueues``) names a ClusterQueue whose
  ``resourceGroups`` give a nominal quota per resource (summed over flavors). Pending Workloads
  are taken by priority (their pods' PriorityClass value), then creation time; one is admitted
  when the requests of the ClusterQueue's admitted Workloads plus its own fit every covered
  resource's quota: its gates are removed (BestEffortFIFO: a Workload that does not fit does
  not hold later ones back).
* Preemption: with ``preemption.withinClusterQueue: LowerPriority``, a pending Workload that
  does not fit evicts admitted ones of a lower priority (lowest first, newest first) until it
  would: each of their pods gets the condition ``DisruptionTarget`` reason ``Preempted`` and is
  deleted with its grace period. An evicted Workload's pods hold its quota until they are gone.

Not emulated: cohorts and borrowing, flavors as node selectors, fair sharing, admission checks,
topology-aware scheduling, Workload objects (the state lives on the pods).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from omni_operator import capacity
from omni_operator.kueue import GATE, GROUP_LABEL, GROUP_TOTAL, QUEUE_LABEL, gated

Obj = dict[str, Any]
API = "kueue.x-k8s.io/v1beta1"
RESOURCES: list[tuple[str, str, bool, bool, tuple[str, ...]]] = [
    (f"{API}/clusterqueues", "ClusterQueue", False, True, ("cq",)),
    (f"{API}/localqueues", "LocalQueue", True, True, ("queue", "queues", "lq")),
]  # fmt: skip
"""What the API emulator serves for it (key, kind, namespaced, status, short names)."""
PREEMPTED = "Preempted"
log = logging.getLogger("omni.sandbox")


async def gate(obj: Obj) -> None:
    """Kueue's mutating webhook: gate a queued pod at its creation."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if obj.get("kind") != "Pod" or QUEUE_LABEL not in labels:
        return
    spec = obj.setdefault("spec", {})
    gates = spec.setdefault("schedulingGates", [])
    if not any(g.get("name") == GATE for g in gates):
        gates.append({"name": GATE})


@dataclass
class Workload:
    key: tuple[str, str]
    pods: list[Obj]
    queue: str
    priority: int
    created: str
    total: int

    @property
    def complete(self) -> bool:
        return len(self.pods) >= self.total

    @property
    def admitted(self) -> bool:
        return not any(gated(p) for p in self.pods)

    def requests(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pod in self.pods:
            for k, v in capacity.pod_requests(pod).items():
                out[k] = out.get(k, 0.0) + v
        return out


@dataclass
class KueueEmulator:
    """Admits and preempts the sandbox's queued pods (see the module docstring)."""

    api: str
    tick_s: float = 0.2
    _http: aiohttp.ClientSession | None = field(default=None, init=False)

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            self._http = http
            while True:
                try:
                    await self.tick()
                except aiohttp.ClientError as err:
                    log.warning(f"sandbox kueue: API call failed: {err}")
                await asyncio.sleep(self.tick_s)

    async def tick(self) -> None:
        pods, classes, cqs, lqs = await asyncio.gather(
            self._list("/api/v1/pods"),
            self._list("/apis/scheduling.k8s.io/v1/priorityclasses"),
            self._list(f"/apis/{API}/clusterqueues"),
            self._list(f"/apis/{API}/localqueues"),
        )
        to_cq = {(q["metadata"].get("namespace") or "default", q["metadata"]["name"]):
                 (q.get("spec") or {}).get("clusterQueue") for q in lqs}  # fmt: skip
        values = {c["metadata"]["name"]: int(c.get("value") or 0) for c in classes}
        by_cq: dict[str, list[Workload]] = {}
        for w in workloads(pods, values):
            cq = to_cq.get((w.key[0], w.queue))
            if cq:
                by_cq.setdefault(cq, []).append(w)
        for cq in cqs:
            await self._admit(cq, by_cq.get(cq["metadata"]["name"], []))

    async def _admit(self, cq: Obj, members: list[Workload]) -> None:
        quota = nominal_quota(cq)
        preempt = ((cq.get("spec") or {}).get("preemption") or {}).get("withinClusterQueue")
        admitted = [w for w in members if w.admitted]
        pending = sorted((w for w in members if not w.admitted and w.complete),
                         key=lambda w: (-w.priority, w.created, w.key))  # fmt: skip
        for w in pending:
            if fits(quota, admitted, w):
                await self._ungate(w)
                admitted.append(w)
                continue
            if preempt != "LowerPriority":
                continue
            victims = preemption_victims(quota, admitted, w)
            for v in victims:
                await self._evict(v, w)
                # its pods hold the quota until gone: admission waits for a later tick

    async def _ungate(self, w: Workload) -> None:
        log.warning(f"sandbox kueue: admitted {w.key[0]}/{w.key[1]} ({len(w.pods)} pods)")
        for pod in w.pods:
            gates = [g for g in pod["spec"].get("schedulingGates") or [] if g.get("name") != GATE]
            await self._patch(_pod_path(pod), {"spec": {"schedulingGates": gates or None}})

    async def _evict(self, victim: Workload, by: Workload) -> None:
        live = [p for p in victim.pods if not p["metadata"].get("deletionTimestamp")]
        if live:
            log.warning(f"sandbox kueue: {by.key[1]} preempts {victim.key[1]}")
        now = dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {"type": "DisruptionTarget", "status": "True", "reason": PREEMPTED,
                "message": "Preempted to accommodate a higher priority Workload",
                "lastTransitionTime": now}  # fmt: skip
        for pod in live:
            conds = [c for c in (pod.get("status") or {}).get("conditions") or []
                     if c.get("type") != cond["type"]]  # fmt: skip
            await self._patch(_pod_path(pod, "status"), {"status": {"conditions": [*conds, cond]}})
            assert self._http is not None
            async with self._http.delete(self.api + _pod_path(pod)) as resp:
                if resp.status not in (200, 202, 404):
                    resp.raise_for_status()

    async def _list(self, path: str) -> list[Obj]:
        assert self._http is not None
        async with self._http.get(self.api + path) as resp:
            if resp.status == 404:
                return []
            resp.raise_for_status()
            return (await resp.json()).get("items") or []

    async def _patch(self, path: str, body: Obj) -> None:
        assert self._http is not None
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self._http.patch(self.api + path, json=body, headers=headers) as resp:
            if resp.status not in (200, 404):
                resp.raise_for_status()


def workloads(pods: Sequence[Obj], priorities: Mapping[str, int]) -> list[Workload]:
    """The queued pods grouped into Workloads (ended pods no longer count)."""
    out: dict[tuple[str, str], Workload] = {}
    for pod in pods:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
        phase = (pod.get("status") or {}).get("phase")
        if QUEUE_LABEL not in labels or phase in capacity.ENDED:
            continue
        ns = meta.get("namespace") or "default"
        group = labels.get(GROUP_LABEL)
        key = (ns, group or meta["name"])
        w = out.get(key)
        if w is None:
            w = out[key] = Workload(
                key=key, pods=[], queue=labels[QUEUE_LABEL],
                priority=priorities.get(spec.get("priorityClassName") or "", 0),
                created=str(meta.get("creationTimestamp") or ""),
                total=int(notes.get(GROUP_TOTAL, 1)) if group else 1,
            )  # fmt: skip
        w.pods.append(pod)
        w.created = min(w.created, str(meta.get("creationTimestamp") or ""))
    return list(out.values())


def nominal_quota(cq: Obj) -> dict[str, float]:
    """Nominal quota per covered resource, summed over the ClusterQueue's flavors."""
    out: dict[str, float] = {}
    for group in (cq.get("spec") or {}).get("resourceGroups") or []:
        for name in group.get("coveredResources") or []:
            out.setdefault(name, 0.0)
        for flavor in group.get("flavors") or []:
            for r in flavor.get("resources") or []:
                out[r["name"]] = out.get(r["name"], 0.0) + (
                    capacity.quantity(r.get("nominalQuota", 0)) or 0.0
                )
    return out


def fits(quota: Mapping[str, float], admitted: Sequence[Workload], w: Workload) -> bool:
    used: dict[str, float] = {}
    for a in admitted:
        for k, v in a.requests().items():
            used[k] = used.get(k, 0.0) + v
    return all(used.get(k, 0.0) + v <= quota[k] + 1e-9
               for k, v in w.requests().items() if k in quota)  # fmt: skip


def preemption_victims(
    quota: Mapping[str, float], admitted: Sequence[Workload], w: Workload
) -> list[Workload]:
    """Lower-priority admitted Workloads whose eviction lets ``w`` fit (lowest priority, then
    newest first); none when evicting all of them would not suffice."""
    candidates = sorted((a for a in admitted if a.priority < w.priority),
                        key=lambda a: (a.priority, _neg(a.created)))  # fmt: skip
    keep, victims = list(admitted), []
    for c in candidates:
        if fits(quota, keep, w):
            break
        keep.remove(c)
        victims.append(c)
    return victims if fits(quota, keep, w) else []


def _neg(created: str) -> tuple[int, ...]:
    return tuple(-ord(ch) for ch in created)


def _pod_path(pod: Obj, sub: str | None = None) -> str:
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta.get('namespace') or 'default'}/pods/{meta['name']}"
    return f"{path}/{sub}" if sub else path
