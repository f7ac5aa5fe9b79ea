"""Reconciliation: from what is observed to what to do (a pure function over plain data).

The operator's engine (``omni_operator.handlers.engine``) reads the job, the objects it owns, the
Nodes and the trainer's progress, calls :func:`reconcile`, and applies the returned
:class:`Actions` (creates, deletes, adoptions, one status merge patch, Events). Everything is
derived from the observation and the job's own status, never from memory, so the same
observation always yields the same actions: an operator restarted in the middle of a reconcile
finds the pods it created by name and neither duplicates nor forgets them.

Phases::

    Pending ─► Placing ─► Starting ─► Running ─► Succeeded
      │          ▲  │         │           │
      │          │  └───◄─────┴───────────┤ failure: Restarting (backoff) ─► Placing/Starting
      │          │                        └ user error / budget spent: Failed
      └─ spec.suspend: Suspended (pods deleted) ─ resume: a new attempt

Placing/Queued: a job that fits the nodes but not beside what runs there now waits in ``Queued``
(``omni_operator.admission``: free capacity, first come first served within a priority).

``Starting`` means the attempt's pods exist but not all trainers run yet: condition
``PodsRunning`` names what the scheduler or the kubelet says (Unschedulable, ErrImagePull...),
and ``restartPolicy.startTimeoutSeconds`` bounds the time to the trainer's first step.
``Running``: every trainer container runs. An in-place restart keeps the pods (``podAttempt``
names the attempt that created them) and, after the backoff, writes the new attempt into each
pod's order annotation for its supervisor (updating the pod makes its kubelet refresh the file
at once; a ConfigMap alone reaches a running pod at the kubelet's next periodic sync). Pods are
named per attempt (``<job>-a<attempt>-n<rank>``), so a restart never waits for a pod stuck
Terminating on a lost node: those are force-deleted (grace 0) instead.

With ``scheduling.placement: scheduler`` the attempt's pods name no node (admission still
queues a job that does not fit beside what runs); ``status.placement`` stays empty until the
scheduler bound every pod, then node ranks follow the bound nodes' network domains and names
(:func:`omni_operator.placement.rank_bound`) and reach the pods' standby supervisors through
their order, with the rank label that moves the rendezvous address (:func:`_rank_bound`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_operator import admission, kube_objects, kueue, quarantine, spares, stragglers, times
from omni_operator.placement import PlacedNode, PlacementError, place, rank_bound
from omni_operator.recovery import failures, restarts
from omni_operator.render import (
    LABEL_ATTEMPT,
    LABEL_RANK,
    attempt_order,
    by_scheduler,
    config_map_name,
    order_patch,
    rank_patch,
    render_all,
    render_config_map,
    render_rendezvous_service,
    render_service,
    spare_env,
)
from omni_operator.spec import OmniTrainingJob, format_warnings, spec_warnings
from omni_operator.status import (
    CheckpointStatus,
    Condition,
    OmniTrainingJobStatus,
    Phase,
    PreflightStatus,
    RestartRecord,
)
from omni_trainer.pod_protocol import ATTEMPT_KEY
from omni_trainer.termination import FinalReport

Obj = dict[str, Any]
TERMINAL: frozenset[str] = frozenset({"Succeeded", "Failed"})
PRUNED_KINDS = ("Pod", "PodGroup")
"""Kinds that belong to one attempt: objects of these kinds that are not desired are deleted
(as are objects labelled with an attempt: its rendezvous Service)."""
HISTORY_LIMIT = 50
"""Restart records kept in status (quarantine counts what is kept)."""


@dataclass(frozen=True)
class Progress:
    """What the trainer last reported (its metrics endpoint)."""

    step: int | None = None
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    resumed_from: int | None = None
    """The checkpoint step the running attempt resumed from (0: from the start)."""
    since_first_step_s: float | None = None
    """The final report only: seconds from the attempt's first step to the end of training."""
    node_busy: Mapping[int, float] | None = None
    """Busy seconds per step by node rank (a window median; None: not reported yet)."""
    attempt: int | None = None
    """The restart attempt of the trainer that answered (None: unknown); a trainer of an earlier
    attempt, not yet killed by an in-place restart, is not this attempt's progress."""


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile looks at."""

    job: OmniTrainingJob
    status: OmniTrainingJobStatus
    owned: Sequence[Obj]
    """Objects labelled with the job (pods of every attempt, ConfigMap, Service, PodGroups)."""
    nodes: Sequence[Obj]
    now: dt.datetime
    progress: Progress | None = None
    tracks_progress: bool = False
    """A progress source is configured: hang detection and "crash before the first step" need it."""
    generation: int | None = None
    cluster_pods: Sequence[Obj] | None = None
    """Every pod of the cluster when the job is to be placed (None: unknown; placed on the
    nodes' allocatable alone, with no queue)."""
    queue_ahead: Sequence[tuple[str, str]] = ()
    """Queued jobs served before this one (``admission.queue_ahead``)."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Delete:
    obj: Obj
    grace_seconds: int | None = None
    """0 forces the deletion (a pod on a lost node never confirms it)."""


@dataclass
class Actions:
    """What to do, in order: delete, adopt (merge-patch), create, then patch the status."""

    create: list[Obj] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    adopt: list[Obj] = field(default_factory=list)
    """Merge patches for existing objects (kind, metadata.name/namespace plus the changes)."""
    status: dict[str, Any] = field(default_factory=dict)
    """A merge patch of ``status`` (camelCase keys; None removes a field)."""
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """Reconcile again after this many seconds (a backoff ends), if not sooner."""


# -- desired vs actual --------------------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    create: tuple[Obj, ...] = ()
    delete: tuple[Obj, ...] = ()
    adopt: tuple[Obj, ...] = ()
    waiting: tuple[Obj, ...] = ()
    """Desired objects whose name is still taken by one being deleted."""


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def diff(
    desired: Sequence[Obj], existing: Sequence[Obj], *, prune_kinds: Sequence[str] = PRUNED_KINDS
) -> Diff:
    """Creates, deletes and adoptions that turn ``existing`` into ``desired`` (matched by kind
    and name). Existing objects of ``prune_kinds`` or labelled with an attempt (its rendezvous
    Service) that are not desired are deleted; others (ConfigMap, the job's Service) are never
    deleted here. An existing desired object without the job's ownerReference is adopted (the
    reference and labels patched in), never recreated."""
    have = {object_key(o): o for o in existing}
    want = {object_key(o): o for o in desired}
    create, adopt, waiting = [], [], []
    for key, obj in want.items():
        cur = have.get(key)
        if cur is None:
            create.append(obj)
        elif cur["metadata"].get("deletionTimestamp"):
            waiting.append(obj)
        elif _needs_adoption(obj, cur):
            adopt.append(
                {
                    "apiVersion": obj["apiVersion"],
                    "kind": obj["kind"],
                    "metadata": {
                        "name": obj["metadata"]["name"],
                        "namespace": obj["metadata"].get("namespace"),
                        "labels": obj["metadata"].get("labels", {}),
                        "ownerReferences": obj["metadata"]["ownerReferences"],
                    },
                }
            )
    delete = [
        o
        for key, o in have.items()
        if key not in want
        and (o["kind"] in prune_kinds or LABEL_ATTEMPT in (o["metadata"].get("labels") or {}))
        and not o["metadata"].get("deletionTimestamp")
    ]
    return Diff(tuple(create), tuple(delete), tuple(adopt), tuple(waiting))


def _needs_adoption(desired: Obj, current: Obj) -> bool:
    refs = desired["metadata"].get("ownerReferences") or []
    if not refs:
        return False
    have = {r.get("uid") for r in current["metadata"].get("ownerReferences") or []}
    labels = current["metadata"].get("labels") or {}
    want_labels = desired["metadata"].get("labels") or {}
    return refs[0]["uid"] not in have or any(labels.get(k) != v for k, v in want_labels.items())


# -- conditions ---------------------------------------------------------------------------------


def set_condition(
    conditions: Sequence[Condition],
    *,
    type: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str = "",
    now: str,
    generation: int | None = None,
) -> list[Condition]:
    """The conditions with one set (idempotent: an unchanged condition is returned as it was;
    ``lastTransitionTime`` moves only when ``status`` changes). Order is kept, new ones last."""
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type:
            out.append(c)
            continue
        found = True
        same = c.status == status
        new = Condition(
            type=type,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=c.last_transition_time if same else now,
            observed_generation=generation,
        )
        out.append(c if new == c else new)
    if not found:
        out.append(
            Condition(
                type=type,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now,
                observed_generation=generation,
            )
        )
    return out


def get_condition(conditions: Sequence[Condition], type: str) -> Condition | None:
    return next((c for c in conditions if c.type == type), None)


# -- the reconcile step -------------------------------------------------------------------------


def parse_status(raw: Mapping[str, Any] | None) -> OmniTrainingJobStatus:
    """The status as the operator wrote it; fields it does not know (or a mangled status) are
    dropped rather than stopping the job."""
    data = dict(raw or {})
    known = {f.alias or n for n, f in OmniTrainingJobStatus.model_fields.items()}
    data = {k: v for k, v in data.items() if k in known}
    try:
        return OmniTrainingJobStatus.model_validate(data)
    except ValueError:
        return OmniTrainingJobStatus()


def status_patch(
    old: OmniTrainingJobStatus, new: OmniTrainingJobStatus, *, full: bool = False
) -> dict[str, Any]:
    """A merge patch with the top-level status fields that changed (kopf's own ``kopf`` field
    is never touched); ``full`` also writes unchanged defaults (the first write, so that
    ``kubectl get`` shows restarts 0 rather than nothing)."""
    a = old.model_dump(mode="json", by_alias=True, exclude={"kopf"})
    b = new.model_dump(mode="json", by_alias=True, exclude={"kopf"})
    return {
        k: b.get(k)
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) or (full and b.get(k) is not None)
    }


class _Step:
    """One reconcile: accumulates the new status, actions and Events."""

    def __init__(self, obs: Observed) -> None:
        self.obs = obs
        self.job = obs.job
        self.spec = obs.job.spec
        self.old = obs.status
        self.st = obs.status
        self.now = obs.now
        self.now_s = times.format_time(obs.now)
        self.actions = Actions()
        self.nodes = {n["metadata"]["name"]: n for n in obs.nodes}

    # status helpers
    def set(self, **changes: Any) -> None:
        self.st = self.st.model_copy(update=changes)

    def condition(
        self, type: str, status: Literal["True", "False", "Unknown"], reason: str, msg: str = ""
    ) -> None:
        conds = set_condition(
            self.st.conditions,
            type=type,
            status=status,
            reason=reason,
            message=msg,
            now=self.now_s,
            generation=self.obs.generation,
        )
        self.set(conditions=conds)

    def phase(self, phase: Phase, message: str, *, event: Event | None = None) -> None:
        changed = self.st.phase != phase or self.st.message != message
        if changed and event is not None:
            self.actions.events.append(event)
        self.set(phase=phase, message=message)

    def event(self, type: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.actions.events.append(Event(type, reason, message))

    def finish(self) -> Actions:
        self.set(observed_generation=self.obs.generation)
        self.actions.status = status_patch(self.old, self.st, full=self.old.phase is None)
        return self.actions

    # pods
    def pods(self) -> list[Obj]:
        return [o for o in self.obs.owned if o["kind"] == "Pod"]

    def attempt_pods(self) -> list[Obj]:
        """The pods the current attempt's trainers run in (an in-place restart keeps them; a
        spare that took a rank over is one of them, the pod it replaced no longer)."""
        return [
            p
            for p in self.gang()
            if not spares.is_standby(p) and not spares.replaced(p, self.st.placement)
        ]

    def gang(self) -> list[Obj]:
        """Pods of the gang the trainers run in: its rank pods and its standby spares."""
        return [p for p in self.pods() if _attempt_label(p) == self.st.pods_of]

    def unrecorded(self) -> list[Obj]:
        """Pods of an attempt newer than the status records: a start writes its status after
        creating the pods, so when that conditional write met a newer job (409) the re-run
        reads the old status beside the new pods. It decides again and adopts them (placement
        is deterministic); deleting them as strays would fail the attempt it just started."""
        return [p for p in self.pods() if _attempt_label(p) > self.st.attempt]

    def standby(self) -> list[Obj]:
        return [p for p in self.gang() if spares.is_standby(p)]

    def drop_spares(self) -> None:
        """The job ends or is suspended: its standby pods go, and ``status.spares`` with them."""
        self.delete_pods(self.standby())
        self.set(spares=[])

    def stopping_pods(self) -> list[str]:
        """Pods of earlier attempts still running their grace period on a live node."""
        mine = {id(p) for p in self.attempt_pods()}
        going = []
        for pod in self.pods():
            node = kube_objects.pod_node(pod, ())
            live = node in self.nodes and not kube_objects.node_not_ready_since(
                self.nodes[node], self.now
            )
            phase = (pod.get("status") or {}).get("phase")
            if id(pod) not in mine and live and phase not in TERMINAL:
                going.append(pod["metadata"]["name"])
        return sorted(going)

    def delete_pods(self, pods: Sequence[Obj]) -> None:
        """Delete pods; those on lost (or missing) nodes are forced, including the ones already
        stuck Terminating there."""
        for pod in pods:
            node = kube_objects.pod_node(pod, self.st.placement)
            lost = node is not None and (
                node not in self.nodes
                or kube_objects.node_not_ready_since(self.nodes[node], self.now) is not None
            )
            if pod["metadata"].get("deletionTimestamp") and not lost:
                continue  # already going, nothing to force
            self.actions.delete.append(Delete(pod, 0 if lost else None))


def _transport_condition(s: _Step) -> None:
    """Condition InterNodeRDMA on multi-node GPU jobs: whether NCCL may use InfiniBand/RoCE
    between nodes, or TCP sockets (then with the field to set), never silently."""
    if s.spec.nodes < 2 or not s.spec.gpus_per_node:
        return
    if s.spec.resources.rdma is not None:
        rdma = s.spec.resources.rdma
        s.condition("InterNodeRDMA", "True", "RDMA", f"{rdma.count} {rdma.resource_name} per pod")
        return
    why = format_warnings(spec_warnings(s.spec))
    chosen = "nccl.env sets NCCL_IB_DISABLE"
    s.condition("InterNodeRDMA", "False", "TCPSockets", why[0] if why else chosen)


def reconcile(obs: Observed) -> Actions:
    """The actions that move the job one step towards its spec (see the module docstring).

    Args:
        obs: the job, its status, owned objects, Nodes, trainer progress and the time.

    Returns:
        Creates, deletes, adoptions, a status merge patch, Events and when to look again.
    """
    s = _Step(obs)
    if s.st.phase in TERMINAL:
        return s.actions  # kept as they ended (pods stay for their logs)
    if s.st.start_time is None:
        s.set(start_time=s.now_s)
    if s.st.restart_budget_left is None:
        s.set(restart_budget_left=s.spec.restart_policy.budget)
    s.condition("Valid", "True", "SpecValid", "the spec passed validation")
    _transport_condition(s)

    keep = s.attempt_pods() + s.standby() + s.unrecorded()
    s.delete_pods([p for p in s.pods() if p not in keep])

    if s.spec.suspend:
        return _suspend(s)
    if s.st.phase == "Suspended":  # resumed: a fresh attempt, so no pod name is reused
        s.set(attempt=s.st.attempt + 1, pod_attempt=None, last_progress_time=None)
        s.condition("Suspended", "False", "Resumed", "spec.suspend is false")
        s.event("Normal", "Resumed", f"resuming as attempt {s.st.attempt}")
        s.set(phase="Pending")

    if s.st.phase == "Restarting" and s.st.restart_history:
        last = s.st.restart_history[-1]
        due = times.parse_time(last.time)
        if due is not None:
            due += dt.timedelta(seconds=last.delay_seconds)
            if s.now < due:
                s.actions.requeue_after = (due - s.now).total_seconds()
                return s.finish()
        if last.reason in failures.GRACEFUL_REASONS and (going := s.stopping_pods()):
            # Their trainers are writing an emergency checkpoint: the next attempt resumes from
            # it (and would fence it off if it started first). Their grace bounds the wait.
            why = f"waiting for {', '.join(going)} to stop (emergency checkpoint)"
            s.condition("PodsRunning", "False", "Stopping", why)
            s.actions.requeue_after = 1.0
            return s.finish()

    pods = s.attempt_pods()
    if s.st.phase == "Restarting" and pods and s.st.pod_attempt is not None:
        return _restart_in_place(s, pods)
    if s.st.phase == "Queued" and not pods and (going := s.stopping_pods()):
        why = f"waiting for {', '.join(going)} to stop (emergency checkpoint)"  # preempted
        s.condition("PodsRunning", "False", "Stopping", why)
        s.actions.requeue_after = 1.0
        return s.finish()
    started = s.st.phase in ("Starting", "Running") or (s.st.phase == "Queued" and s.st.placement)
    if not pods or not started:  # Queued with a placement: its pods wait for Kueue
        # Also when some pods exist but the status never recorded the attempt as started (the
        # operator stopped between creating pods and writing the status): placement is
        # deterministic, so the diff adopts what exists and creates only what is missing.
        return _start_attempt(s)
    return _watch_attempt(s, pods)


def _attempt_label(pod: Obj) -> int:
    """The attempt a pod was created for (-1 without the label: not the operator's)."""
    label = (pod["metadata"].get("labels") or {}).get(LABEL_ATTEMPT, "")
    return int(label) if label.isdigit() else -1


def _suspend(s: _Step) -> Actions:
    s.delete_pods(s.attempt_pods() + s.unrecorded())
    s.drop_spares()
    s.condition("Suspended", "True", "Suspended", "spec.suspend is true: pods deleted")
    s.condition("PodsRunning", "False", "Suspended", "")
    s.phase(
        "Suspended",
        "suspended by spec.suspend; the job resumes from its latest checkpoint when unset",
        event=Event("Normal", "Suspended", "spec.suspend is true: deleting the pods"),
    )
    return s.finish()


def _start_attempt(s: _Step) -> Actions:
    """No pods for this attempt yet: place, render and create them (or queue the job)."""
    _lift_quarantine(s)
    verdict = admission.admit(s.obs.nodes, s.job, quarantined=s.st.quarantined_nodes,
                              cluster_pods=s.obs.cluster_pods, ahead=s.obs.queue_ahead)  # fmt: skip
    placement = verdict.placement
    if verdict.queued:
        return _queue(s, verdict)
    if placement is None:
        return _unplaceable(s, verdict.message)
    s.set(placing_since=None)
    if admission.was_queued(s.st.conditions):
        s.condition("Queued", "False", "Admitted", "free capacity found")
    desired = render_all(s.job, placement, attempt=s.st.attempt,
                         quarantined=s.st.quarantined_nodes)  # fmt: skip
    d = diff(desired, s.obs.owned)
    s.actions.create += d.create
    s.actions.adopt += d.adopt
    s.actions.adopt += _config_updates(desired, s.obs.owned)
    s.actions.delete += [Delete(o) for o in d.delete if o["kind"] != "Pod"]  # stale pods: above
    names, n = placement.names, s.spec.nodes
    scheduled = by_scheduler(s.job)
    s.set(placement=[] if scheduled else names, last_progress_time=None,
          attempt_start_time=s.now_s, first_step_time=None)  # fmt: skip
    if scheduled:
        s.condition("Placed", "False", "Scheduling", f"0 of {n} pods bound by the scheduler")
    else:
        s.condition("Placed", "True", "Placed", placement.explain())
    s.condition("PodsRunning", "False", "PodsCreated", f"0 of {n} pods running")
    verb = "restarting" if s.st.attempt and s.st.restart_history else "starting"
    where = "for the scheduler to place" if scheduled else "on " + _nodes_str(placement.nodes)
    s.phase(
        "Starting",
        f"attempt {s.st.attempt} {verb} on {n} node{'s' if n > 1 else ''}",
        event=Event("Normal", "PodsCreated", f"attempt {s.st.attempt}: {n} pods {where}"),
    )
    return s.finish()


def _rank_bound(s: _Step, pods: list[Obj]) -> Actions | None:
    """The scheduler placed the attempt's pods: once every one is bound, each gets its node
    rank from where they landed (:func:`omni_operator.placement.rank_bound`), its rank label
    and, in its order, its rank's environment, which its standby supervisor starts the trainer
    with. None while pods wait to be bound (watched as any starting attempt: the start timeout
    runs) or a bound node is gone (the failure it is)."""
    bound = {str(p["metadata"]["name"]): (p.get("spec") or {}).get("nodeName") for p in pods}
    nodes = list(bound.values())
    if len(pods) != s.spec.nodes or not all(n in s.nodes for n in nodes):
        n = sum(bool(x) for x in nodes)
        s.condition("Placed", "False", "Scheduling", f"{n} of {s.spec.nodes} pods bound by "
                    "the scheduler")  # fmt: skip
        return None
    placement = rank_bound([s.nodes[str(n)] for n in nodes], s.spec)
    pod_on = {node: pod for pod, node in bound.items()}
    by_pod = {p["metadata"]["name"]: p for p in pods}
    ranks = {pod_on[x.name]: x for x in placement.nodes}
    st = s.st
    doc = attempt_order(st.attempt, pods=st.pods_of, fresh=st.attempt != st.pods_of,
                        spares={pod: spare_env(s.job, x) for pod, x in ranks.items()})  # fmt: skip
    s.actions.adopt += [rank_patch(by_pod[pod], x, doc) for pod, x in ranks.items()]
    s.set(placement=placement.names)
    s.condition("Placed", "True", "BoundByScheduler",
                "node ranks from the nodes the scheduler bound the pods to (by network domain, "
                "then name):\n" + placement.explain())  # fmt: skip
    s.event("Normal", "RanksAssigned", f"attempt {st.attempt}: " + ", ".join(
        f"rank {x.rank} to {pod} on {x.name}" for pod, x in sorted(
            ranks.items(), key=lambda kv: kv[1].rank)))  # fmt: skip
    s.actions.requeue_after = 1.0
    return s.finish()


def _queue(s: _Step, verdict: admission.Decision) -> Actions:
    """The job fits the cluster but not beside what runs now: it waits, creating nothing."""
    summary = verdict.message.splitlines()[0]
    s.condition("Queued", "True", verdict.reason, verdict.message)
    s.condition("Placed", "False", verdict.reason, summary)
    s.phase("Queued", f"queued: {summary}",
            event=Event("Normal", "Queued", verdict.message))  # fmt: skip
    return s.finish()


def _unplaceable(s: _Step, msg: str) -> Actions:
    """No placement: wait (condition Placed False, looking again when a quarantine may lift)
    until ``restartPolicy.placementTimeoutSeconds``, then fail the job with the reason."""
    since = times.parse_time(s.st.placing_since) or s.now
    s.set(placing_since=times.format_time(since))
    timeout = s.spec.restart_policy.placement_timeout_seconds
    waited = (s.now - since).total_seconds()
    held = f"; quarantined: {quarantine.describe(s.st.quarantine)}" if s.st.quarantine else ""
    if waited >= timeout:
        why = (f"no placement for {waited:.0f} s (restartPolicy.placementTimeoutSeconds "
               f"{timeout}): {msg.splitlines()[0]}{held}")  # fmt: skip
        s.set(completion_time=s.now_s)
        s.condition("Placed", "False", "Unplaceable", why)
        s.condition("Failed", "True", "Unplaceable", why)
        s.phase("Failed", why, event=Event("Warning", "Unplaceable", why))
        return s.finish()
    s.condition("Placed", "False", "Unschedulable",
                f"{msg}{held}; waiting up to {timeout - waited:.0f} s more")  # fmt: skip
    s.phase(
        "Placing",
        f"waiting for nodes: {msg.splitlines()[0]}",
        event=Event("Warning", "Unschedulable", msg),
    )
    due = [timeout - waited, quarantine.next_lift(s.st.quarantine, s.now) or timeout]
    s.actions.requeue_after = max(min(due), 1.0)
    return s.finish()


def _lift_quarantine(s: _Step) -> None:
    """Lift the quarantines that ended on nodes Ready long enough (an Event each)."""
    kept, lifted = quarantine.lift(
        s.st.quarantine, s.nodes, policy=s.spec.restart_policy, now=s.now
    )
    if lifted:
        gone = {e.node for e in lifted}
        names = [n for n in s.st.quarantined_nodes if n not in gone]
        s.set(quarantine=kept, quarantined_nodes=names)
        s.event("Normal", "QuarantineLifted", f"quarantine lifted: {quarantine.describe(lifted)}")


def _record_quarantine(s: _Step, failure: failures.Failure) -> None:
    """An entry (why, until when) for each node newly in ``quarantinedNodes``."""
    listed = {e.node for e in s.st.quarantine}
    new = [n for n in s.st.quarantined_nodes if n not in listed]
    if new:
        policy, why = s.spec.restart_policy, failure.message
        entries = quarantine.add(
            s.st.quarantine, new, reason=failure.reason, message=why, policy=policy, now=s.now
        )
        s.set(quarantine=entries)


def _restart_in_place(s: _Step, pods: list[Obj]) -> Actions:
    """The backoff ended: tell the pods' supervisors (each pod's order annotation) to restart
    their trainers as the new attempt, which resumes from the latest checkpoint."""
    st = s.st
    slow = {
        str(p["metadata"]["name"]): left
        for p in pods
        if (left := kube_objects.backoff_left(p, s.now)) > restarts.RECREATE_OVER_BACKOFF_S
    }
    if slow:
        return _recreate_over_backoff(s, pods, slow)
    last = st.restart_history[-1] if st.restart_history else None
    fresh = last is not None and last.attempt == st.attempt and last.mode == "spare"
    assigned = spares.assignments(s.job, pods)
    doc = attempt_order(st.attempt, pods=st.pods_of, spares=assigned, fresh=fresh)
    s.actions.adopt += [order_patch(p, doc) for p in pods]
    s.actions.adopt.append(  # read by pods an earlier operator version rendered
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map_name(s.job.metadata.name),
                         "namespace": s.job.metadata.namespace or "default"},
            "data": {ATTEMPT_KEY: doc},
        }
    )  # fmt: skip
    s.set(last_progress_time=None, attempt_start_time=s.now_s, first_step_time=None)
    s.condition("PodsRunning", "False", "RestartingInPlace", f"attempt {st.attempt} starting")
    n = len(pods)
    s.phase(
        "Starting",
        f"attempt {st.attempt} restarting in place in the {n} pod{'s' if n > 1 else ''} of "
        f"attempt {st.pods_of}",
        event=Event(
            "Normal",
            "RestartingInPlace",
            f"attempt {st.attempt}: the trainers restart in the pods of attempt {st.pods_of}",
        ),
    )
    return s.finish()


def _recreate_over_backoff(s: _Step, pods: list[Obj], slow: Mapping[str, float]) -> Actions:
    """A container of the gang waits in the kubelet's CrashLoopBackOff longer than new pods take
    to start (a container that crashed again within 10 minutes: 10 s, 20 s, ... 5 min): the
    restart recreates the pods instead, which start without a back-off."""
    st = s.st
    waits = ", ".join(f"{name} in {left:.0f} s" for name, left in sorted(slow.items()))
    message = (
        f"attempt {st.attempt}: the kubelet restarts {waits} (CrashLoopBackOff): recreating "
        "the pods instead of restarting in place"
    )
    history = list(st.restart_history)
    if history and history[-1].attempt == st.attempt:
        history[-1] = history[-1].model_copy(update={"mode": "recreate"})
    s.delete_pods(pods)
    s.set(restart_history=history, pod_attempt=None, placement=[])
    s.condition("Placed", "False", "Restarting", "re-placed: the in-place restart backs off")
    s.phase("Restarting", message, event=Event("Warning", "RecreatingOverBackOff", message))
    s.actions.requeue_after = 1.0
    return s.finish()


def _nodes_str(nodes: Sequence[PlacedNode]) -> str:
    shown = ", ".join(f"{n.name} (rank {n.rank})" for n in nodes[:8])
    return shown + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")


def _config_updates(desired: Sequence[Obj], existing: Sequence[Obj]) -> list[Obj]:
    """The ConfigMap carries the trainer config of the spec; refresh it when a new attempt
    starts (never under running pods, which read it)."""
    have = {object_key(o): o for o in existing}
    out = []
    for obj in desired:
        cur = have.get(object_key(obj))
        if obj["kind"] == "ConfigMap" and cur is not None and cur.get("data") != obj["data"]:
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": obj["metadata"]["name"],
                        "namespace": obj["metadata"]["namespace"],
                    },
                    "data": obj["data"],
                }
            )
    return out


def _watch_attempt(s: _Step, pods: list[Obj]) -> Actions:
    """Pods of this attempt exist: record progress, detect completion and failures."""
    spec = s.spec
    _ensure_shared_objects(s)
    if spec.scheduling.kueue_queue and (held := _kueue_admission(s, pods)) is not None:
        return held
    if by_scheduler(s.job) and not s.st.placement:
        ranked = _rank_bound(s, pods)
        if ranked is not None:
            return ranked
    phases = [(p.get("status") or {}).get("phase") or "Pending" for p in pods]
    if len(pods) >= spec.nodes and all(ph == "Succeeded" for ph in phases):
        return _succeeded(s, pods)
    _record_progress(s, pods, phases)
    clocks = _AttemptClocks.of(s)
    failure = failures.classify(
        pods,
        s.nodes,
        spec=spec,
        now=s.now,
        last_progress_time=clocks.progress_time,
        started_steps=clocks.started_steps,
        placement=s.st.placement,
        starting_since=clocks.starting_since,
        current=clocks.current,
    )
    if failure is None:
        failure = _straggler_replacement(s)
    if failure is None:
        return _healthy(s, pods, clocks)
    return _recover(s, pods, phases, failure)


def _succeeded(s: _Step, pods: list[Obj]) -> Actions:
    """Every pod of the attempt succeeded: the trainer's final figures, then phase Succeeded."""
    spec, st = s.spec, s.st
    final = final_progress(pods)
    if final is not None:  # the trainer's last word: its final figures
        if st.first_step_time is None and final.since_first_step_s is not None:
            # the attempt ran and ended between two polls: cost its restart from the report
            s.set(restart_history=_restart_cost(s, ago_s=final.since_first_step_s))
        _apply_progress(s, final)
    report = final_report(pods)
    _record_preflight(s, report.preflight if report else None)
    s.drop_spares()
    s.set(completion_time=s.now_s)
    s.condition("PodsRunning", "False", "Completed", "all pods succeeded")
    s.condition("Complete", "True", "Succeeded", f"all {spec.nodes} pods succeeded")
    s.phase(
        "Succeeded",
        f"training finished (attempt {st.attempt}, {st.restarts} restarts)",
        event=Event(
            "Normal", "Succeeded", f"all {spec.nodes} pods of attempt {st.attempt} succeeded"
        ),
    )
    return s.finish()


@dataclass(frozen=True)
class _AttemptClocks:
    """What failure detection reads of the running attempt's progress."""

    started_steps: bool | None
    """Whether the job ever finished a step (None: unknown, no progress source)."""
    starting_since: dt.datetime | None
    """When the attempt started, until its first step (the start timeout runs)."""
    progress_time: dt.datetime | None
    """When the step last advanced, after the first step (the hang timeout runs)."""
    current: failures.Current
    """Which container ends belong to the attempt."""

    @classmethod
    def of(cls, s: _Step) -> _AttemptClocks:
        st = s.st
        started: bool | None = None
        if st.step is not None and st.step > 0:
            started = True
        elif s.obs.tracks_progress:
            started = False
        starting = st.phase == "Starting" or (s.obs.tracks_progress and st.first_step_time is None)
        # Until its first step an attempt is bounded by the start timeout, not the hang timeout:
        # imports and rendezvous of a restart on a busy node are no hang.
        return cls(
            started_steps=started,
            starting_since=times.parse_time(st.attempt_start_time) if starting else None,
            progress_time=None if starting else times.parse_time(st.last_progress_time),
            current=failures.Current(
                st.attempt,
                None if st.pod_attempt is None else times.parse_time(st.attempt_start_time),
            ),
        )


def _healthy(s: _Step, pods: list[Obj], clocks: _AttemptClocks) -> Actions:
    """No failure: lift due quarantines, keep the spares, and look again when a deadline could
    turn the attempt failed with no event to say so (or a quarantine ends)."""
    placement = s.st.placement
    _lift_quarantine(s)  # a node back in time can hold a spare, or the next attempt
    _keep_spares(s)
    due = failures.next_deadline(
        pods,
        s.nodes,
        spec=s.spec,
        now=s.now,
        last_progress_time=clocks.progress_time,
        placement=placement,
        starting_since=clocks.starting_since,
        current=clocks.current,
    )
    lift = quarantine.next_lift(s.st.quarantine, s.now)
    s.actions.requeue_after = min((x for x in (due, lift) if x is not None), default=None)
    return s.finish()


def _recover(s: _Step, pods: list[Obj], phases: list[str], failure: failures.Failure) -> Actions:
    """A failure: decide (restart on a spare, in place or on new pods, or fail the job), record
    the quarantine and the preflight, and act on the decision."""
    spec, st = s.spec, s.st
    latest = st.last_checkpoint.step if st.last_checkpoint else None
    swap = spares.plan_swap(failure, pods, s.standby(), s.nodes, job=s.job, now=s.now)
    mode = "spare" if swap is not None else restarts.restart_mode(failure, pods, spec)
    decision = restarts.decide_restart(
        st.restart_history,
        failure,
        spec,
        s.now,
        latest,
        attempt=st.attempt,
        quarantined=st.quarantined_nodes,
        reached_step=st.step if st.first_step_time is not None else None,
        mode=mode,
    )
    s.set(quarantined_nodes=list(decision.quarantine), restart_budget_left=decision.budget_left)
    _record_quarantine(s, failure)
    _record_preflight(s, failure.preflight)
    if decision.action == "fail":
        s.delete_pods([p for p, ph in zip(pods, phases, strict=True) if ph not in TERMINAL])
        s.drop_spares()
        s.set(completion_time=s.now_s)
        s.condition("PodsRunning", "False", failure.reason, failure.message)
        s.condition("Failed", "True", decision.reason, decision.message)
        s.phase(
            "Failed", decision.message, event=Event("Warning", decision.reason, decision.message)
        )
        return s.finish()
    return _restart(s, pods, failure, decision, swap=swap, mode=mode)


def _restart(
    s: _Step,
    pods: list[Obj],
    failure: failures.Failure,
    decision: restarts.Decision,
    *,
    swap: spares.Swap | None,
    mode: restarts.RestartMode,
) -> Actions:
    """Restart as the next attempt: spares take the lost ranks over, or the pods stay for an
    in-place restart, or they go and the job is placed again."""
    st = s.st
    assert decision.record is not None
    history = [*st.restart_history, decision.record][-HISTORY_LIMIT:]
    s.set(
        attempt=st.attempt + 1,
        restarts=st.restarts + 1,
        restart_history=history,
        last_progress_time=None,
        attempt_start_time=None,
        first_step_time=None,
        stragglers=[],  # measured again by the next attempt
    )
    if swap is not None:  # the survivors stay; spares take the lost ranks over
        _swap_in(s, swap, pods_of=st.pods_of)
    elif mode == "in-place":  # the pods stay, with their placement
        s.set(pod_attempt=st.pods_of)
    else:
        s.delete_pods(pods)
        s.set(pod_attempt=None, placement=[])
        s.condition("Placed", "False", "Restarting", "re-placed when the backoff ends")
    s.condition("PodsRunning", "False", failure.reason, failure.message)
    s.phase(
        "Restarting", decision.message, event=Event("Warning", decision.reason, decision.message)
    )
    s.actions.requeue_after = decision.delay_seconds
    return s.finish()


def _kueue_admission(s: _Step, pods: list[Obj]) -> Actions | None:
    """Kueue gates the attempt (Queued; its start deadline counts from admission) or stopped it
    (preempted: a graceful stop, no restart counted, Queued until admitted again); None when
    it runs admitted (a gated attempt just admitted turns Starting)."""
    queue = s.spec.scheduling.kueue_queue
    stop = kueue.evicted(pods)
    if stop is not None:
        msg = (f"preempted: {stop.describe()}; resumes from its latest checkpoint when Kueue "
               "admits it again (no restart counted)")  # fmt: skip
        s.delete_pods(pods)  # Kueue deletes them too, with their grace: emergency checkpoint
        s.set(attempt=s.st.attempt + 1, pod_attempt=None, placement=[], last_progress_time=None,
              attempt_start_time=None, first_step_time=None)  # fmt: skip
        s.condition("Queued", "True", stop.reason, msg)
        s.condition("PodsRunning", "False", "Preempted", stop.describe())
        s.phase("Queued", msg, event=Event("Warning", "Preempted", msg))
        s.actions.requeue_after = 1.0
        return s.finish()
    gate = kueue.waiting(pods)
    if gate is not None:
        msg = gate.describe(str(queue), len(pods))
        s.set(attempt_start_time=s.now_s)  # the start deadline counts from admission
        s.condition("Queued", "True", gate.reason, msg)
        s.condition("PodsRunning", "False", gate.reason, msg)
        s.phase("Queued", f"queued: {msg}")
        return s.finish()
    if s.st.phase == "Queued":  # admitted since the last look: the start deadline runs
        s.set(attempt_start_time=s.now_s)
        s.condition("Queued", "False", "Admitted", f"admitted by Kueue (LocalQueue {queue})")
        s.phase("Starting", f"attempt {s.st.attempt} admitted by Kueue (LocalQueue {queue})")
    return None


def _swap_in(s: _Step, swap: spares.Swap, *, pods_of: int) -> None:
    """The spares of ``swap`` join the gang (created by attempt ``pods_of``) at their ranks;
    the lost pods go (forced)."""
    placement = list(s.st.placement)
    for rank, spare in sorted(swap.ranks.items()):
        placement[rank] = kube_objects.pod_node(spare) or placement[rank]
        s.actions.adopt.append(spares.relabel(spare, rank))
    s.delete_pods(list(swap.lost))
    assigned = {p["metadata"]["name"] for p in swap.ranks.values()}
    s.set(
        pod_attempt=pods_of,
        placement=placement,
        spares=[x for x in s.st.spares if x.pod not in assigned],
    )
    moved = ", ".join(
        f"rank {r} to {p['metadata']['name']} on {placement[r]}"
        for r, p in sorted(swap.ranks.items())
    )
    s.event("Normal", "SpareAssigned", f"attempt {s.st.attempt}: {moved}")


def _keep_spares(s: _Step) -> None:
    """``spec.spareNodes`` standby pods, refilled in the background; ``status.spares``."""
    standby = s.standby()
    if not s.spec.spare_nodes and not standby:
        return
    plan = spares.refill(
        s.job,
        standby=standby,
        gang_nodes=list(s.st.placement),
        nodes=s.obs.nodes,
        pods_of=s.st.pods_of,
        taken_names=[p["metadata"]["name"] for p in s.pods()],
        quarantined=s.st.quarantined_nodes,
        now=s.now,
    )
    s.delete_pods(list(plan.delete))
    s.actions.create += plan.create
    dropped = {p["metadata"]["name"] for p in plan.delete}
    now = [p for p in standby if p["metadata"]["name"] not in dropped] + list(plan.create)
    status = spares.statuses(now, s.nodes, s.now)
    s.set(spares=status)
    n = sum(x.ready for x in status)
    s.condition(
        "SparesReady",
        "True" if n >= s.spec.spare_nodes else "False",
        "SparesReady" if n >= s.spec.spare_nodes else "SparesMissing",
        f"{n} of {s.spec.spare_nodes} spares ready"
        + ("" if len(status) >= s.spec.spare_nodes else
           f"; no free node for {s.spec.spare_nodes - len(status)} in the job's network domains"),
    )  # fmt: skip


def final_report(pods: Sequence[Obj]) -> FinalReport | None:
    """What node rank 0's trainer wrote to its termination message on success, or None."""
    for pod in pods:
        if (pod["metadata"].get("labels") or {}).get(LABEL_RANK) != "0":
            continue
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term.get("exitCode") != 0 or not term.get("message"):
                continue
            return FinalReport.parse(term["message"])
    return None


def final_progress(pods: Sequence[Obj]) -> Progress | None:
    """The final figures of :func:`final_report`: step, tokens/s, MFU, checkpoints."""
    report = final_report(pods)
    if report is None:
        return None
    return Progress(
        step=report.step,
        checkpoint_step=report.checkpoint_step,
        tokens_per_second=report.tokens_per_second,
        mfu=report.mfu,
        resumed_from=report.resumed_from,
        since_first_step_s=report.since_first_step_s,
    )


def _record_preflight(s: _Step, doc: Any) -> None:
    """``status.preflight`` and the Preflight condition from the trainers' result."""
    if not isinstance(doc, dict):
        return
    status = PreflightStatus.from_report(doc, s.now_s)
    s.set(preflight=status)
    if status.verdict == "Passed":
        figures = ", ".join(f"{x.node} {x.gbps:.3g}" for x in status.nodes if x.gbps is not None)
        s.condition("Preflight", "True", "PreflightPassed", f"node links GB/s: {figures}")
    else:
        s.condition("Preflight", "False", "PreflightFailed", f"failed: {', '.join(status.failed)}")


def throughput_status(p: Progress) -> dict[str, Any]:
    """Status fields of the trainer's throughput, formatted as its logs print them: whole
    tokens/s, MFU as a fraction and as a percent (the printer column)."""
    out: dict[str, Any] = {}
    if p.tokens_per_second is not None:
        out["tokens_per_second"] = round(p.tokens_per_second)
    if p.mfu is not None:
        out.update(mfu=round(p.mfu, 6), mfu_percent=f"{p.mfu:.2%}")
    return out


def _ensure_shared_objects(s: _Step) -> None:
    """The ConfigMap and the Services outlive attempts (the rendezvous Service lives as long
    as the pods it serves); recreate them if someone deleted them."""
    have = {object_key(o) for o in s.obs.owned}
    st = s.st
    for obj in (
        render_config_map(s.job, attempt=st.attempt, pods=st.pods_of),
        render_service(s.job),
        render_rendezvous_service(s.job, attempt=st.pods_of),
    ):
        if object_key(obj) not in have:
            s.actions.create.append(obj)


def _record_progress(s: _Step, pods: list[Obj], phases: list[str]) -> None:
    """Pods running -> condition; trainer progress -> step, checkpoint, lastProgressTime."""
    st, spec = s.st, s.spec
    running = sum(ph == "Running" for ph in phases)
    all_running = running == spec.nodes and len(pods) == spec.nodes
    if all_running:
        s.condition("PodsRunning", "True", "AllPodsRunning", f"{running} of {spec.nodes} running")
        if st.last_progress_time is None and s.obs.tracks_progress:
            s.set(last_progress_time=s.now_s)  # the attempt started: the hang clock starts
        if st.phase == "Starting":
            n = len(pods)
            s.phase("Running", f"attempt {st.attempt} running on {n} node{'s' if n > 1 else ''}")
    else:
        pending = sum(ph == "Pending" for ph in phases)
        issues = failures.start_issues(pods)
        reason = issues[0].reason if issues else "PodsPending" if pending else "PodsNotRunning"
        detail = "".join(f"; {i.describe()}" for i in issues)
        s.condition(
            "PodsRunning",
            "False",
            reason,
            f"{running} of {spec.nodes} running, {pending} pending{detail}",
        )
    p = s.obs.progress
    if p is not None and (p.attempt is None or p.attempt == st.attempt):
        _apply_progress(s, p, all_running=all_running)
        if all_running:
            _watch_stragglers(s, p)


def _straggler_replacement(s: _Step) -> failures.Failure | None:
    """``action: replace`` once due, unless no node could take the straggler's place: then the
    job keeps training on it (slow beats stuck in Placing), and the condition Straggler says
    why (reason NotReplaced, a Warning Event when it becomes so)."""
    st = s.st
    failure = stragglers.replacement(
        st.stragglers,
        checkpoint_step=st.last_checkpoint.step if st.last_checkpoint else None,
        cfg=s.spec.restart_policy.stragglers,
    )
    if failure is None:
        return None
    try:
        place(s.obs.nodes, s.spec, quarantined=[*st.quarantined_nodes, *failure.nodes])
    except PlacementError as err:
        slow = "; ".join(stragglers.describe(x) for x in st.stragglers if x.node in failure.nodes)
        why = f"{slow}; not replaced (no node to take its place): {str(err).splitlines()[0]}"
        before = next((c for c in s.old.conditions if c.type == "Straggler"), None)
        if before is None or before.reason != "NotReplaced":
            s.event("Warning", "StragglerNotReplaced", why)
        s.condition("Straggler", "True", "NotReplaced", why)
        return None
    return failure


def _watch_stragglers(s: _Step, p: Progress) -> None:
    """The nodes' busy times -> ``status.stragglers``, condition Straggler, and a Warning
    Event when a node becomes a straggler (once per detection, not per poll)."""
    cfg = s.spec.restart_policy.stragglers
    if not cfg.enabled or not p.node_busy or p.step is None:
        return
    before = s.st.stragglers
    now = stragglers.track(before, p.node_busy, step=p.step, placement=s.st.placement, cfg=cfg)
    known = {(x.node_rank, x.node) for x in before if x.detected_step is not None}
    detected = [x for x in now if x.detected_step is not None]
    for x in detected:
        if (x.node_rank, x.node) not in known:
            s.event("Warning", "Straggler", stragglers.describe(x))
    s.set(stragglers=now)
    watched = "".join(  # status.stragglers' candidates, named too
        f"; watching {stragglers.describe(x)} (not yet {cfg.persist_steps} steps)"
        for x in now
        if x.detected_step is None
    )
    if detected:
        found = "; ".join(map(stragglers.describe, detected))
        s.condition("Straggler", "True", "SlowNode", found + watched)
    else:
        n = len(p.node_busy)
        s.condition("Straggler", "False", "NoStraggler",
                    f"no node persistently over {cfg.margin:.0%} slower than the others' median "
                    f"({n} node{'s' if n > 1 else ''} reporting){watched}")  # fmt: skip


def _apply_progress(s: _Step, p: Progress, *, all_running: bool = False) -> None:
    """The trainer's figures -> step (the attempt's first one costs its restart), throughput,
    checkpoint (an Event per new one), and the checkpoint the attempt really resumed from."""
    st = s.st
    changes: dict[str, Any] = {}
    if p.step is not None and all_running and st.first_step_time is None:
        changes.update(first_step_time=s.now_s, restart_history=_restart_cost(s))
    if p.step is not None and p.step != st.step:
        changes.update(step=p.step, last_progress_time=s.now_s)
    elif p.step is None and p.resumed_from is not None and p.resumed_from != st.step:
        changes.update(step=p.resumed_from)  # resumed, no step trained yet: where it stands
    changes.update(throughput_status(p))
    known = st.last_checkpoint.step if st.last_checkpoint else 0
    for step in sorted({x for x in (p.resumed_from, p.checkpoint_step) if x and x > known}):
        path = p.checkpoint_path if step == p.checkpoint_step else None
        changes["last_checkpoint"] = CheckpointStatus(step=step, path=path, time=s.now_s)
        changes["restart_budget_left"] = s.spec.restart_policy.budget  # progress refills it
        s.event("Normal", "Checkpoint", f"checkpoint at step {step} complete")
    if p.resumed_from is not None:
        current = changes.get("restart_history", list(st.restart_history))
        history = _confirm_resume(s, p.resumed_from, current)
        if history is not None:
            changes["restart_history"] = history
    if changes:
        s.set(**changes)


def _confirm_resume(
    s: _Step, resumed_from: int, history: list[RestartRecord]
) -> list[RestartRecord] | None:
    """``history`` with this attempt's restart record's ``fromStep`` as the trainer reports it
    (the operator planned the latest checkpoint it had seen; the trainer takes the latest in
    storage) and a ResumedFrom Event, once; None when there is nothing to confirm."""
    if not history or history[-1].attempt != s.st.attempt or history[-1].confirmed:
        return None
    actual = resumed_from or None
    planned = history[-1].from_step
    where = f"checkpoint step {actual}" if actual else "the start (no checkpoint)"
    note = "" if planned == actual else f" (planned: {planned if planned else 'the start'})"
    s.event("Normal", "ResumedFrom", f"attempt {s.st.attempt} resumed from {where}{note}")
    return [*history[:-1], history[-1].resumed(resumed_from)]


def _restart_cost(s: _Step, *, ago_s: float = 0.0) -> list[RestartRecord]:
    """The history with the restart that led to this attempt's first step costed: the seconds
    from its detection to this first step (``ago_s`` seconds before now)."""
    history = list(s.st.restart_history)
    if history and history[-1].attempt == s.st.attempt and history[-1].lost_seconds is None:
        since = times.parse_time(history[-1].time)
        if since is not None:
            lost = max((s.now - since).total_seconds() - ago_s, 0.0)
            history[-1] = history[-1].model_copy(update={"lost_seconds": lost})
    return history
