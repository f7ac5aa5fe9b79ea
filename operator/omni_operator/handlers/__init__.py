"""kopf handlers of the OmniTrainingJob operator: ``kopf run -m omni_operator.handlers``
(or ``omni operator``).

Thin on purpose: each handler reads the job and what it owns, calls the pure
:func:`omni_operator.reconcile.reconcile`, and applies the result. Every job has one daemon, its
reconcile loop: it wakes when a pod of the job or a Node it runs on changes (watch events), when
the reconcile asked to look again (a backoff, a node's grace or the hang timeout ends), and at the
latest every resync period (the trainer's progress is polled, not pushed); a job queued for
capacity also wakes when any job's pod changes. Create, resume and spec
updates (suspend/resume included) reconcile at once. All of them run the same level-based
reconcile, serialized per job by a lock, so whichever comes first does the work and the others find
nothing to do; bursts of events (512 pods turning Running) coalesce into one wake-up. The status
is written with a merge patch inside that lock (not through kopf's ``patch``, which lands after the
handler returns): the next reconcile must see what this one decided, or a restart could be
decided twice. A reconcile that may place pods holds one operator-wide lock from its observation
(every pod of the cluster, the queued jobs) to its writes, so two jobs never place onto the same
free capacity.

Configuration (environment): ``OMNI_RESYNC_SECONDS`` (the longest a job goes unreconciled,
default 10), ``OMNI_API_SERVER`` (talk to this URL without credentials, e.g. the sandbox
emulator), ``OMNI_OPERATOR_VOLCANO`` (also manage Volcano PodGroups),
``OMNI_OPERATOR_METRICS_PORT`` (serve the operator's Prometheus metrics).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import kopf

from omni_operator import reconcile as rec
from omni_operator.admission import queue_ahead
from omni_operator.handlers.kube import JOB_API, ApiError, Kube, obj_path, url_path
from omni_operator.metrics import Fleet, NullOperatorMetrics, OperatorMetrics
from omni_operator.progress import MetricsProgress
from omni_operator.recovery import format_time, node_not_ready_since, pod_node, with_reports
from omni_operator.render import LABEL_ATTEMPT, LABEL_JOB
from omni_operator.reports import SupervisorReports
from omni_operator.spec import GROUP, PLURAL, VERSION, OmniTrainingJob, parse_job
from omni_operator.status import OmniTrainingJobStatus
from omni_trainer.config import ManifestError

RESOURCE = (GROUP, VERSION, PLURAL)
FINALIZER = f"{GROUP}/cleanup"
EVENT_MESSAGE_LIMIT = 1000  # the API server rejects longer Event messages
RETRY_SECONDS = 2.0  # after a reconcile failed (API server unreachable)
CONFLICT_RETRIES = 5  # reconciles in a row whose status write met a newer job (409)
T = TypeVar("T")
PLACED = ("Starting", "Running")
"""Phases whose attempt's pods exist: their reconcile places nothing."""
WAITING = ("Placing", "Queued")
"""Phases of jobs waiting for nodes: a Node change wakes them."""

ProgressSource = Callable[
    [OmniTrainingJob, Sequence[dict[str, Any]]], Awaitable[rec.Progress | None]
]
"""Reads the trainer's progress (step, checkpoint, tokens/s, MFU) for a job from its pods."""
ReportSource = Callable[[list[dict[str, Any]]], Awaitable[dict[str, dict[str, Any]]]]
"""Reads the failed attempts in-place pods' supervisors report (pod name -> failure)."""


JobKey = tuple[str, str]  # (namespace, name)


class Wakeup:
    """Why a job's reconcile loop should run now; many pokes before it runs count as one."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason = ""

    def poke(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    async def wait(
        self, timeout: float | None, *, stop: asyncio.Future[Any] | None = None
    ) -> str | None:
        """The reason of the first poke within ``timeout`` seconds (None: timed out, or
        ``stop`` finished first)."""
        poked = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({poked} | ({stop} if stop else set()), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            poked.cancel()  # no-op once done; never left pending (timeout, stop, cancellation)
        if not poked.done() or poked.cancelled():
            return None
        self._event.clear()
        return self.reason


@dataclass
class OperatorState:
    """Shared by every handler of this operator process (kept in kopf's memo)."""

    kube: Kube = field(default_factory=Kube)
    progress: ProgressSource | None = None
    """Default: the trainer's metrics endpoint (``progress.MetricsProgress``). None: no source
    (no hang detection; a crash is never taken for a user error)."""
    reports: ReportSource | None = None
    """Default: each unready in-place pod's supervisor (``reports.SupervisorReports``). None:
    none read (a failure then shows only when a container ends)."""
    volcano: bool = False
    locks: dict[JobKey, asyncio.Lock] = field(default_factory=dict)
    metrics: OperatorMetrics | NullOperatorMetrics = field(default_factory=NullOperatorMetrics)
    fleet: Fleet = field(default_factory=Fleet)
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(tz=dt.UTC)
    """The time reconciles see (tests move it forward instead of sleeping through timeouts)."""
    resync_seconds: float = 10.0
    """The longest a job goes unreconciled (progress polling, missed events)."""
    wakeups: dict[JobKey, Wakeup] = field(default_factory=dict)
    placing: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a reconcile that may place pods, from its observation to its writes."""
    job_nodes: dict[JobKey, frozenset[str]] = field(default_factory=dict)
    """The nodes each job's pods are placed on, as its last reconcile saw them."""
    node_facts: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """What placement and recovery read from each Node, as last seen (heartbeats excluded)."""

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def wakeup(self, key: JobKey) -> Wakeup:
        return self.wakeups.setdefault(key, Wakeup())

    def forget(self, key: JobKey) -> None:
        self.locks.pop(key, None)
        self.wakeups.pop(key, None)
        self.job_nodes.pop(key, None)
        self.fleet.forget(key)


def state(memo: kopf.Memo) -> OperatorState:
    """The operator's state in kopf's memo; ``memo.progress_source`` / ``memo.api_server``
    (set by whoever starts the operator, e.g. tests or the sandbox) are picked up here."""
    if "omni" not in memo:
        memo["omni"] = OperatorState(
            progress=memo.get("progress_source") or MetricsProgress(),
            reports=memo.get("report_source") or SupervisorReports(),
            clock=memo.get("clock") or (lambda: dt.datetime.now(tz=dt.UTC)),
            resync_seconds=float(
                memo.get("resync_seconds") or os.environ.get("OMNI_RESYNC_SECONDS", "10")
            ),
            metrics=memo.get("metrics") or NullOperatorMetrics(),
            volcano=os.environ.get("OMNI_OPERATOR_VOLCANO", "false").lower() == "true",
        )
    return memo["omni"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """All settings in one place. Scanning is off: the operator knows its one CRD and the chart
    grants no CRD/namespace listing. Events are posted by the handlers (kopf.event), kopf's own
    log lines only from warnings up."""
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    # Only the jobs' pods are watched, filtered by the API server: a cluster's other pods never
    # reach the operator (the handler's label filter alone would be applied client-side).
    settings.watching.label_selectors[("", "v1", "pods")] = LABEL_JOB
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    st = state(memo)
    port = os.environ.get("OMNI_OPERATOR_METRICS_PORT")
    if port and isinstance(st.metrics, NullOperatorMetrics):
        st.metrics = OperatorMetrics()
        # on the pod's address where one is given (the sandbox's pods share a loopback)
        st.metrics.serve(int(port), addr=os.environ.get("OMNI_METRICS_ADDR", "0.0.0.0"))


@kopf.on.login()
def login(
    memo: kopf.Memo, settings: kopf.OperatorSettings, logger: logging.Logger, **kwargs: Any
) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else kubeconfig; ``memo.api_server`` or ``OMNI_API_SERVER``
    name an unauthenticated API server (the sandbox's emulator, tests)."""
    server = memo.get("api_server") or os.environ.get("OMNI_API_SERVER")
    if server:
        info: kopf.ConnectionInfo | None = kopf.ConnectionInfo(
            server=str(server), default_namespace="default"
        )
    else:
        info = kopf.login_with_service_account(
            settings=settings, logger=logger, **kwargs
        ) or kopf.login_with_kubeconfig(settings=settings, logger=logger, **kwargs)
    if info is not None:
        state(memo).kube.use(info)
    return info


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    st = state(memo)
    await st.kube.close()
    st.metrics.close()


@kopf.on.create(*RESOURCE)
@kopf.on.resume(*RESOURCE)
async def start(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Validate, place, create (or adopt) the ConfigMap, Service and pods; after an operator
    restart the same reconcile finds what exists and continues from there."""
    await _reconcile(state(memo), namespace, name, "create")


@kopf.on.update(*RESOURCE, field="spec")
async def spec_changed(
    name: str, namespace: str, body: kopf.Body, diff: kopf.Diff, memo: kopf.Memo, **_: Any
) -> None:
    """Suspend/resume act at once; other changes reach the pods at their next restart (pods are
    immutable, and restarting a healthy job on every edit would waste its progress)."""
    st = state(memo)
    fields = sorted({".".join(map(str, ("spec", *d[1]))) for d in diff})
    if any(f != "spec.suspend" for f in fields) and not await _retry_invalid(st, namespace, name):
        kopf.event(
            body,
            type="Normal",
            reason="SpecChanged",
            message=f"changed {', '.join(fields)}: applies when the pods are next (re)created",
        )
    await _reconcile(st, namespace, name, "update")
    st.wakeup((namespace, name)).poke("update")  # a finished (rejected) job polls again


async def _retry_invalid(st: OperatorState, namespace: str, name: str) -> bool:
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


async def _stopped(stopped: kopf.DaemonStopped) -> None:
    await stopped.wait()


@kopf.daemon(*RESOURCE, cancellation_timeout=1.0)
async def reconcile_loop(
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: logging.Logger,
    stopped: kopf.DaemonStopped,
    **_: Any,
) -> None:
    """The job's reconcile loop: detect failures, restart, complete (see the module docstring).
    A finished job sleeps until an event wakes it (a fixed invalid spec); the loop returns as
    soon as kopf asks it to stop (job deleted, operator exiting), so it is never cancelled."""
    st = state(memo)
    wakeup = st.wakeup((namespace, name))
    stop = asyncio.ensure_future(_stopped(stopped))
    try:
        await _loop(st, namespace, name, logger, wakeup, stop)
    finally:
        stop.cancel()


async def _loop(
    st: OperatorState,
    namespace: str,
    name: str,
    logger: logging.Logger,
    wakeup: Wakeup,
    stop: asyncio.Future[None],
) -> None:
    """Reconcile on every wake-up (event, deadline, resync) until ``stop`` is done."""
    timeout: float | None = st.resync_seconds
    while True:
        reason = await wakeup.wait(timeout, stop=stop)
        if stop.done():
            return
        if reason is None:
            reason = "resync" if timeout == st.resync_seconds else "deadline"
        try:
            outcome = await _reconcile(st, namespace, name, reason)
        except kopf.PermanentError:
            outcome = FINISHED  # rejected: status and Event say why; a spec fix wakes us
        except Exception as err:  # the API server is away, a conflict: try again soon
            logger.warning(f"reconcile ({reason}) failed, retrying: {err!r}")
            outcome = Outcome(requeue_after=min(st.resync_seconds, RETRY_SECONDS))
        if outcome.finished:
            timeout = None
        elif outcome.requeue_after is not None:
            timeout = min(max(outcome.requeue_after, 0.05), st.resync_seconds)
        else:
            timeout = st.resync_seconds


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A pod of a job changed (phase, exit, deletion): its job looks at once."""
    st = state(memo)
    key = (namespace, labels[LABEL_JOB])
    if key in st.wakeups:
        st.wakeups[key].poke("pod")
    for other, wakeup in st.wakeups.items():  # capacity may have freed for the queue
        if st.fleet.phases.get(other) == "Queued":
            wakeup.poke("capacity")


@kopf.on.event("", "v1", "nodes")
async def node_event(name: str, body: kopf.Body, type: str, memo: kopf.Memo, **_: Any) -> None:
    """A Node changed what placement or recovery reads (readiness, taints, labels, GPUs):
    the jobs on it look at once, and so do jobs waiting for nodes. Heartbeats are ignored."""
    st = state(memo)
    facts = None if type == "DELETED" else node_facts(body)
    if st.node_facts.get(name) == facts:
        return
    if facts is None:
        st.node_facts.pop(name, None)
    else:
        st.node_facts[name] = facts
    for key, wakeup in st.wakeups.items():
        if st.fleet.phases.get(key) in WAITING or name in st.job_nodes.get(key, ()):
            wakeup.poke("node")


def node_facts(node: dict[str, Any]) -> tuple[Any, ...]:
    """The parts of a Node that change a job's placement or health."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    since = node_not_ready_since(node, dt.datetime.now(tz=dt.UTC))
    return (
        since is None,
        since.isoformat() if since is not None else None,
        bool(spec.get("unschedulable")),
        repr(spec.get("taints") or []),
        repr(sorted(((node.get("metadata") or {}).get("labels") or {}).items())),
        repr(sorted((status.get("allocatable") or {}).items())),
    )


@kopf.on.delete(*RESOURCE)
async def delete(
    name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Delete what the job owns. A real cluster garbage-collects it through ownerReferences
    anyway; doing it here makes deletion prompt and independent of the garbage collector."""
    st = state(memo)
    async with st.lock(namespace, name):
        owned = await _owned(st, namespace, name)
        await st.kube.gather(st.kube.delete(obj_path(o)) for o in owned)
    st.forget((namespace, name))
    st.fleet.export(st.metrics)
    logger.info(f"deleted {len(owned)} owned objects")


async def _owned(st: OperatorState, namespace: str, name: str) -> list[dict[str, Any]]:
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


@dataclass(frozen=True)
class Outcome:
    """What one reconcile tells the job's loop: stop polling, or look again when."""

    finished: bool = False
    requeue_after: float | None = None


FINISHED = Outcome(finished=True)


async def _reconcile(st: OperatorState, namespace: str, name: str, handler: str) -> Outcome:
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
        _owned(st, namespace, name), kube.list(url_path("v1", "Node"))
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
