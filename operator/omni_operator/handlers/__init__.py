"""kopf handlers of the OmniTrainingJob operator: ``kopf run -m omni_operator.handlers``
(or ``omni operator``).

Thin on purpose: each handler reads the job and what it owns, calls the pure
:func:`omni_operator.reconcile.reconcile`, and applies the result. Create, resume, spec
updates (suspend/resume included) and a periodic timer all run the same level-based reconcile,
serialized per job by a lock, so whichever fires first does the work and the others find
nothing to do. The status is written with a merge patch inside that lock (not through kopf's
``patch``, which lands after the handler returns): the next reconcile must see what this one
decided, or a restart could be decided twice.

Configuration (environment, read at import): ``OMNI_RESYNC_SECONDS`` (timer interval, default
10), ``OMNI_API_SERVER`` (talk to this URL without credentials, e.g. the sandbox emulator),
``OMNI_OPERATOR_VOLCANO`` (also manage Volcano PodGroups), ``OMNI_OPERATOR_METRICS_PORT``
(serve the operator's Prometheus metrics).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from omni_operator import reconcile as rec
from omni_operator.handlers.kube import JOB_API, Kube, obj_path, url_path
from omni_operator.metrics import Fleet, NullOperatorMetrics, OperatorMetrics
from omni_operator.progress import MetricsProgress
from omni_operator.recovery import format_time
from omni_operator.render import LABEL_JOB
from omni_operator.spec import GROUP, PLURAL, VERSION, OmniTrainingJob, parse_job
from omni_trainer.config import ManifestError

RESOURCE = (GROUP, VERSION, PLURAL)
RESYNC_SECONDS = float(os.environ.get("OMNI_RESYNC_SECONDS", "10"))
FINALIZER = f"{GROUP}/cleanup"
EVENT_MESSAGE_LIMIT = 1000  # the API server rejects longer Event messages

ProgressSource = Callable[
    [OmniTrainingJob, Sequence[dict[str, Any]]], Awaitable[rec.Progress | None]
]
"""Reads the trainer's progress (step, checkpoint, tokens/s, MFU) for a job from its pods."""


@dataclass
class OperatorState:
    """Shared by every handler of this operator process (kept in kopf's memo)."""

    kube: Kube = field(default_factory=Kube)
    progress: ProgressSource | None = None
    """Default: the trainer's metrics endpoint (``progress.MetricsProgress``). None: no source
    (no hang detection; a crash is never taken for a user error)."""
    volcano: bool = False
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    metrics: OperatorMetrics | NullOperatorMetrics = field(default_factory=NullOperatorMetrics)
    fleet: Fleet = field(default_factory=Fleet)
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(tz=dt.UTC)
    """The time reconciles see (tests move it forward instead of sleeping through timeouts)."""

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


def state(memo: kopf.Memo) -> OperatorState:
    """The operator's state in kopf's memo; ``memo.progress_source`` / ``memo.api_server``
    (set by whoever starts the operator, e.g. tests or the sandbox) are picked up here."""
    if "omni" not in memo:
        memo["omni"] = OperatorState(
            progress=memo.get("progress_source") or MetricsProgress(),
            clock=memo.get("clock") or (lambda: dt.datetime.now(tz=dt.UTC)),
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
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    st = state(memo)
    port = os.environ.get("OMNI_OPERATOR_METRICS_PORT")
    if port and isinstance(st.metrics, NullOperatorMetrics):
        st.metrics = OperatorMetrics()
        st.metrics.serve(int(port))


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
    if any(f != "spec.suspend" for f in fields):
        conds = rec.parse_status(body.get("status")).conditions
        invalid = rec.get_condition(conds, "Valid")
        if invalid is not None and invalid.status == "False":  # an invalid job was fixed: retry
            await st.kube.patch(
                url_path(
                    JOB_API, "OmniTrainingJob", namespace=namespace, name=name, subresource="status"
                ),
                {"status": {"phase": None, "message": None, "completionTime": None}},
            )
        else:
            kopf.event(
                body,
                type="Normal",
                reason="SpecChanged",
                message=f"changed {', '.join(fields)}: applies when the pods are next (re)created",
            )
    await _reconcile(st, namespace, name, "update")


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, sharp=False)
async def resync(name: str, namespace: str, status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
    """Watch pods, nodes and progress: detect failures, restart, complete."""
    if status.get("phase") in rec.TERMINAL:
        return
    await _reconcile(state(memo), namespace, name, "timer")


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
    st.locks.pop((namespace, name), None)
    st.fleet.forget((namespace, name))
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


async def _reconcile(st: OperatorState, namespace: str, name: str, handler: str) -> None:
    """Observe -> reconcile (pure) -> apply, under the job's lock."""
    with st.metrics.reconcile(handler):
        await _reconcile_locked(st, namespace, name)


async def _reconcile_locked(st: OperatorState, namespace: str, name: str) -> None:
    kube = st.kube
    job_path = url_path(JOB_API, "OmniTrainingJob", namespace=namespace, name=name)
    async with st.lock(namespace, name):
        raw = await kube.get(job_path)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return
        status = rec.parse_status(raw.get("status"))
        if status.phase in rec.TERMINAL:
            return
        try:
            job = parse_job(raw)
        except ManifestError as err:
            await _reject(kube, raw, job_path, status, str(err), now=st.clock())
            raise kopf.PermanentError(f"invalid OmniTrainingJob:\n{err}") from None
        owned, nodes = await asyncio.gather(
            _owned(st, namespace, name), kube.list(url_path("v1", "Node"))
        )
        pods = [o for o in owned if o["kind"] == "Pod"]
        progress = await st.progress(job, pods) if st.progress is not None else None
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
            now=st.clock().timestamp(),
        )
        if recovered is not None:
            st.metrics.observe_recovery(recovered)
        st.fleet.export(st.metrics)


async def _apply(kube: Kube, raw: dict[str, Any], job_path: str, actions: rec.Actions) -> None:
    """Deletes, adoptions, creates (each batch concurrent), then the status, then Events."""
    await kube.gather(
        kube.delete(obj_path(d.obj), grace_seconds=d.grace_seconds) for d in actions.delete
    )
    await kube.gather(kube.patch(obj_path(a), a) for a in actions.adopt)
    shared = [o for o in actions.create if o["kind"] != "Pod"]
    await kube.gather(kube.create(o) for o in shared)  # pods mount the ConfigMap: it goes first
    await kube.gather(kube.create(o) for o in actions.create if o["kind"] == "Pod")
    if actions.status:
        await kube.patch(job_path + "/status", {"status": actions.status})
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
    await kube.patch(job_path + "/status", {"status": rec.status_patch(status, new)})
    kopf.event(raw, type="Warning", reason="InvalidSpec", message=errors[:EVENT_MESSAGE_LIMIT])
