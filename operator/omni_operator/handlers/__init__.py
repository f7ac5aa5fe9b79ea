"""kopf handlers of the OmniTrainingJob operator: ``kopf run -m omni_operator.handlers``
(or ``omni operator``).

Thin on purpose: each handler unpacks what kopf hands it and calls the package's parts, which
stand on each other in this order:

- :mod:`~omni_operator.handlers.kube`: the async API client;
- :mod:`~omni_operator.handlers.operator_state`: what the handlers share (locks, wake-ups);
- :mod:`~omni_operator.handlers.engine`: one job's observe -> reconcile (pure) -> apply;
- :mod:`~omni_operator.handlers.loop`: every job's daemon, its reconcile loop.

Create, resume and spec updates (suspend/resume included) reconcile at once; pod and Node
events wake the loops of the jobs they concern.

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
from typing import Any

import kopf

from omni_operator.handlers import engine
from omni_operator.handlers.loop import run_job_loop
from omni_operator.handlers.operator_state import OperatorState
from omni_operator.kube_objects import node_not_ready_since
from omni_operator.metrics import NullOperatorMetrics, OperatorMetrics
from omni_operator.progress import MetricsProgress
from omni_operator.render import LABEL_JOB
from omni_operator.reports import SupervisorReports
from omni_operator.spec import GROUP, PLURAL, VERSION

RESOURCE = (GROUP, VERSION, PLURAL)
FINALIZER = f"{GROUP}/cleanup"
WAITING = ("Placing", "Queued")
"""Phases of jobs waiting for nodes: a Node change wakes them."""


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
    await engine.reconcile_job(state(memo), namespace, name, "create")


@kopf.on.update(*RESOURCE, field="spec")
async def spec_changed(
    name: str, namespace: str, body: kopf.Body, diff: kopf.Diff, memo: kopf.Memo, **_: Any
) -> None:
    """Suspend/resume act at once; other changes reach the pods at their next restart (pods are
    immutable, and restarting a healthy job on every edit would waste its progress)."""
    st = state(memo)
    fields = sorted({".".join(map(str, ("spec", *d[1]))) for d in diff})
    others = any(f != "spec.suspend" for f in fields)
    if others and not await engine.retry_invalid(st, namespace, name):
        kopf.event(
            body,
            type="Normal",
            reason="SpecChanged",
            message=f"changed {', '.join(fields)}: applies when the pods are next (re)created",
        )
    await engine.reconcile_job(st, namespace, name, "update")
    st.wakeup((namespace, name)).poke("update")  # a finished (rejected) job polls again


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
    """The job's reconcile loop: detect failures, restart, complete (:mod:`.loop`).
    A finished job sleeps until an event wakes it (a fixed invalid spec); the loop returns as
    soon as kopf asks it to stop (job deleted, operator exiting), so it is never cancelled."""
    st = state(memo)
    wakeup = st.wakeup((namespace, name))
    stop = asyncio.ensure_future(_stopped(stopped))
    try:
        await run_job_loop(st, namespace, name, logger, wakeup, stop)
    finally:
        stop.cancel()


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
    deleted = await engine.delete_owned(st, namespace, name)
    st.forget((namespace, name))
    st.fleet.export(st.metrics)
    logger.info(f"deleted {deleted} owned objects")
