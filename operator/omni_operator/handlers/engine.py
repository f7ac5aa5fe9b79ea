"""One job's reconcile: observe -> reconcile (pure) -> apply, under the job's lock.

:func:`reconcile_job` reads the job, what it owns, the Nodes, the trainer's progress and the
supervisors' reports, calls the pure :func:`omni_operator.reconcile.reconcile`, and applies the
returned actions. The status is written with a merge patch inside the lock (not through kopf's
``patch``, which lands after the handler returns), conditional on the job as read: the next
reconcile must see what this one decided, or a restart could be decided twice; a write that
meets a newer job (409) re-runs the whole reconcile. A reconcile that may place pods holds the
operator-wide ``placing`` lock from its observation (every pod of the cluster, the queued jobs)
to its writes, so two jobs never place onto the same free capacity.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import kopf

from omni_operator import reconcile as rec
from omni_operator.admission import queue_ahead
from omni_operator.handlers.kube import JOB_API, ApiError, Kube, obj_path, url_path
from omni_operator.handlers.operator_state import JobKey, OperatorState
from omni_operator.kube_objects import pod_node
from omni_operator.recovery.failures import with_reports
from omni_operator.render import LABEL_ATTEMPT, LABEL_JOB
from omni_operator.spec import OmniTrainingJob, parse_job
from omni_operator.status import OmniTrainingJobStatus
from omni_operator.times import format_time
from omni_trainer.config import ManifestError

EVENT_MESSAGE_LIMIT = 1000  # the API server rejects longer Event messages
CONFLICT_RETRIES = 5  # reconciles in a row whose status write met a newer job (409)
T = TypeVar("T")
PLACED = ("Starting", "Running")
"""Phases whose attempt's pods exist: their reconcile places nothing."""


@dataclass(frozen=True)
class Outcome:
    """What one reconcile tells the job's loop: stop polling, or look again when."""

    finished: bool = False
    requeue_after: float | None = None


FINISHED = Outcome(finished=True)


async def reconcile_job(st: OperatorState, namespace: str, name: str, handler: str) -> Outcome:
    """Observe -> reconcile (pure) -> apply, under the job's lock; ``handler`` says what
    triggered it (metrics label)."""
    with st.metrics.reconcile(handler):
        return await _reconcile_locked(st, namespace, name)


async def _on_conflict_retry(once: Callable[[], Awaitable[T]]) -> T:
    """Run ``once`` again (it re-reads the job) while its conditional status write meets a
    newer job (409 Conflict): a decision is only written over the state it was made from."""
    for _ in range(CONFLICT_RETRIES - 1):
        try:
            return await once()
        except ApiError as err:
            if err.status != 409:
                raise
    return await once()


async def _reconcile_locked(st: OperatorState, namespace: str, name: str) -> Outcome:
    async with st.lock(namespace, name):
        return await _on_conflict_retry(lambda: _reconcile_once(st, namespace, name))


async def _reconcile_once(st: OperatorState, namespace: str, name: str) -> Outcome:
    kube = st.kube
    job_path = url_path(JOB_API, "OmniTrainingJob", namespace=namespace, name=name)
    raw = await kube.get(job_path)
    if raw is None or raw["metadata"].get("deletionTimestamp"):
        return FINISHED
    status = rec.parse_status(raw.get("status"))
    if status.phase in rec.TERMINAL:
        return FINISHED
    try:
        job = parse_job(raw)
    except ManifestError as err:
        await _reject(kube, raw, job_path, status, str(err), now=st.clock())
        st.fleet.observe(
            (namespace, name), phase="Failed", quarantined=0, now=st.clock().timestamp()
        )
        raise kopf.PermanentError(f"invalid OmniTrainingJob:\n{err}") from None
    if status.phase in PLACED:
        return await _observe_and_apply(st, raw, job, status, (namespace, name))
    async with st.placing:  # one placement at a time sees the pods the others created
        return await _observe_and_apply(st, raw, job, status, (namespace, name), placing=True)


async def _observe_and_apply(
    st: OperatorState,
    raw: dict[str, Any],
    job: OmniTrainingJob,
    status: OmniTrainingJobStatus,
    key: JobKey,
    *,
    placing: bool = False,
) -> Outcome:
    """Observe (``placing``: also every pod of the cluster and the queue), reconcile, apply."""
    kube, (namespace, name) = st.kube, key
    job_path = url_path(JOB_API, "OmniTrainingJob", namespace=namespace, name=name)
    owned, nodes = await asyncio.gather(
        owned_objects(st, namespace, name), kube.list(url_path("v1", "Node"))
    )
    cluster_pods, ahead = await _queue_view(st.kube, raw, namespace) if placing else (None, [])
    pods = [o for o in owned if o["kind"] == "Pod"]
    current = [p for p in pods if p["metadata"]["labels"].get(LABEL_ATTEMPT) == str(status.pods_of)]
    progress, reports = await asyncio.gather(
        st.progress(job, current) if st.progress is not None else _none(),  # not stale
        st.reports(pods) if st.reports is not None else _none(),
    )
    if reports:
        owned = with_reports(owned, reports)
    actions = rec.reconcile(
        rec.Observed(
            job=job,
            status=status,
            owned=owned,
            nodes=nodes,
            now=st.clock(),
            progress=progress,
            tracks_progress=st.progress is not None,
            generation=raw["metadata"].get("generation"),
            cluster_pods=cluster_pods,
            queue_ahead=ahead,
        )
    )
    await _apply(kube, raw, job_path, actions)
    phase = actions.status.get("phase", status.phase)
    if actions.status.get("phase") == "Restarting":
        st.metrics.record_restart(actions.status["restartHistory"][-1]["reason"])
    quarantined = actions.status.get("quarantinedNodes", status.quarantined_nodes)
    recovered = st.fleet.observe(
        (namespace, name),
        phase=phase or "Pending",
        quarantined=len(quarantined or ()),
        stragglers=0 if phase in rec.TERMINAL else _stragglers(actions.status, status),
        now=st.clock().timestamp(),
    )
    if recovered is not None:
        st.metrics.observe_recovery(recovered)
    st.fleet.export(st.metrics)
    st.job_nodes[(namespace, name)] = frozenset(
        filter(None, (pod_node(p) for p in pods + actions.create if p["kind"] == "Pod"))
    )
    if phase in rec.TERMINAL:
        return FINISHED
    return Outcome(requeue_after=actions.requeue_after)


async def _none() -> None:
    return None


async def _queue_view(
    kube: Kube, raw: dict[str, Any], namespace: str
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Every pod of the cluster and the queued jobs served before this one (those of the job's
    namespace when the operator is granted only its namespaces)."""
    pods, jobs, classes = await asyncio.gather(
        _list_wide(kube, "v1", "Pod", namespace),
        _list_wide(kube, JOB_API, "OmniTrainingJob", namespace),
        kube.list(url_path("scheduling.k8s.io/v1", "PriorityClass")),
    )
    return pods, queue_ahead(raw, jobs, classes)


async def _list_wide(kube: Kube, api: str, kind: str, namespace: str) -> list[dict[str, Any]]:
    """All namespaces' objects, else (403: a namespaced install) the namespace's."""
    try:
        return await kube.list(url_path(api, kind))
    except ApiError as err:
        if err.status != 403:
            raise
        return await kube.list(url_path(api, kind, namespace=namespace))


def _stragglers(patch: dict[str, Any], status: OmniTrainingJobStatus) -> int:
    """Nodes detected as stragglers after this reconcile (the patch, else the old status)."""
    if "stragglers" in patch:
        return sum(x.get("detectedStep") is not None for x in patch["stragglers"] or ())
    return sum(x.detected_step is not None for x in status.stragglers)


async def _apply(kube: Kube, raw: dict[str, Any], job_path: str, actions: rec.Actions) -> None:
    """Deletes, adoptions, creates (each batch concurrent), the status, then Events.

    The status write is conditional on the job this reconcile read (a 409 re-runs it). A status
    that starts pods is written after them (a half-created attempt is not recorded as started);
    any other (a restart, a failure, a suspension) before the deletes it orders, so that only
    the reconcile whose decision was recorded acts on it."""
    starts_pods = any(o["kind"] == "Pod" for o in actions.create)
    if actions.status and not starts_pods:
        await _write_status(kube, raw, job_path, actions.status)
    await kube.gather(
        kube.delete(obj_path(d.obj), grace_seconds=d.grace_seconds) for d in actions.delete
    )
    await kube.gather(kube.patch(obj_path(a), a) for a in actions.adopt)
    shared = [o for o in actions.create if o["kind"] != "Pod"]
    await kube.gather(kube.create(o) for o in shared)  # pods mount the ConfigMap: it goes first
    await kube.gather(kube.create(o) for o in actions.create if o["kind"] == "Pod")
    if actions.status and starts_pods:
        await _write_status(kube, raw, job_path, actions.status)
    for e in actions.events:
        kopf.event(raw, type=e.type, reason=e.reason, message=e.message[:EVENT_MESSAGE_LIMIT])


async def _reject(
    kube: Kube,
    raw: dict[str, Any],
    job_path: str,
    status: Any,
    errors: str,
    *,
    now: dt.datetime,
) -> None:
    """Invalid spec: phase Failed, condition Valid=False and a Warning Event naming the fields."""
    conds = rec.set_condition(
        status.conditions,
        type="Valid",
        status="False",
        reason="InvalidSpec",
        message=errors,
        now=format_time(now),
        generation=raw["metadata"].get("generation"),
    )
    new = status.model_copy(
        update={"phase": "Failed", "message": f"invalid spec: {errors}", "conditions": conds}
    )
    await _write_status(kube, raw, job_path, rec.status_patch(status, new))
    kopf.event(raw, type="Warning", reason="InvalidSpec", message=errors[:EVENT_MESSAGE_LIMIT])


async def _write_status(
    kube: Kube, raw: dict[str, Any], job_path: str, status: dict[str, Any]
) -> None:
    """A merge patch of the status, conditional on the job's resourceVersion as read (the API
    server answers 409 when another writer came in between)."""
    rv = raw["metadata"].get("resourceVersion")
    body: dict[str, Any] = {"status": status}
    if rv:
        body["metadata"] = {"resourceVersion": rv}
    await kube.patch(job_path + "/status", body)


async def owned_objects(st: OperatorState, namespace: str, name: str) -> list[dict[str, Any]]:
    """The objects the job owns: its pods, ConfigMap, Services (and PodGroups with Volcano)."""
    selector = f"{LABEL_JOB}={name}"
    kinds = [("v1", "Pod"), ("v1", "ConfigMap"), ("v1", "Service")]
    if st.volcano:
        kinds.append(("scheduling.volcano.sh/v1beta1", "PodGroup"))
    lists = await asyncio.gather(
        *(
            st.kube.list(url_path(api, kind, namespace=namespace), label_selector=selector)
            for api, kind in kinds
        )
    )
    return [o for objs in lists for o in objs]


async def retry_invalid(st: OperatorState, namespace: str, name: str) -> bool:
    """An invalid job whose spec changed starts over (its Failed status is cleared, under the
    job's lock and conditional on the job read there); False when it was not invalid."""
    path = url_path(JOB_API, "OmniTrainingJob", namespace=namespace, name=name)

    async def once() -> bool:
        raw = await st.kube.get(path)
        if raw is None:
            return True
        invalid = rec.get_condition(rec.parse_status(raw.get("status")).conditions, "Valid")
        if invalid is None or invalid.status != "False":
            return False
        cleared = {"phase": None, "message": None, "completionTime": None}
        await _write_status(st.kube, raw, path, cleared)
        return True

    async with st.lock(namespace, name):
        return await _on_conflict_retry(once)


async def delete_owned(st: OperatorState, namespace: str, name: str) -> int:
    """Delete what the job owns, under its lock; how many objects that was."""
    async with st.lock(namespace, name):
        owned = await owned_objects(st, namespace, name)
        await st.kube.gather(st.kube.delete(obj_path(o)) for o in owned)
    return len(owned)
