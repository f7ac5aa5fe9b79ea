"""Recovery: what went wrong with a running attempt, and whether to restart it (pure functions).

:func:`classify` looks at the pods of the current attempt and the Nodes they run on and names
one failure (or none). The order matters because one root cause shows several symptoms: a lost
node makes its peers fail with NCCL errors, so a lost node wins over failed pods; an eviction
over a crash; a non-retryable exit code over a generic one; a missing pod over a hang. A
container lost or killed from outside is infrastructure at any step (:mod:`failure_origin`):
only the trainer's own error before its first step is taken for a configuration error.
Before its first step an attempt can also be stuck: pods that cannot be scheduled, images that
cannot be pulled, containers that cannot be created (:func:`start_issues`). An image that does
not exist fails the job at once; the others are waited for up to
``restartPolicy.startTimeoutSeconds`` from the pods' creation, then the attempt is restarted.

:func:`decide_restart` turns a failure into a decision: a whole-job restart after exponential
backoff, or failing the job (a user error, or the restart budget is spent). :func:`restart_mode`
says how: with ``restartPolicy.mode: in-place`` a crashed or hung trainer whose pods all still
run restarts inside them (the pods' supervisors start the new attempt); pods that are gone, or
``mode: recreate``, mean new pods. A container the kubelet restarted in place keeps its end in
``lastState``: :class:`Current` tells this attempt's ends from older ones. The budget counts
restarts *without progress*: a checkpoint newer than the one the last restart resumed from
refills it, so a week-long job survives many unrelated failures while a crash loop stops soon.

Nodes blamed for node-attributable failures are quarantined (:func:`quarantined_nodes`) once
they reach ``restartPolicy.quarantineAfterFailures`` within ``quarantineSeconds``, and placement
avoids them until :mod:`quarantine` lifts them.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_operator.failure_origin import LOST_REASONS, device_error, infrastructure_cause
from omni_operator.quarantine import to_quarantine
from omni_operator.render import ANNOTATION_NODE, LABEL_RANK
from omni_operator.spec import GROUP, OmniTrainingJobSpec, RestartPolicyConfig
from omni_operator.status import RestartRecord
from omni_operator.times import format_time, parse_time
from omni_trainer.distributed.netcheck_rules import parse_failure
from omni_trainer.pod_protocol import untag

Obj = Mapping[str, Any]
FailureKind = Literal[
    "node_lost",
    "pod_failed",
    "pod_evicted",
    "pod_deleted",
    "hang",
    "user_error",
    "image_pull_failed",
    "start_timeout",
    "stopped",
    "preflight_failed",
    "straggler",
    "container_lost",
    "device_error",
]

REASONS: Mapping[FailureKind, str] = {
    "node_lost": "NodeLost",
    "pod_failed": "PodFailed",
    "pod_evicted": "PodEvicted",
    "pod_deleted": "PodDeleted",
    "hang": "Hang",
    "user_error": "UserError",
    "image_pull_failed": "ImagePullFailed",
    "start_timeout": "StartTimeout",
    "stopped": "GracefulStop",
    "preflight_failed": "PreflightFailed",
    "straggler": "Straggler",
    "container_lost": "ContainerLost",
    "device_error": "DeviceError",
}
"""CamelCase reasons for status, conditions and Events (Kubernetes convention)."""

EXIT_STOPPED = 143
"""The trainer's exit after a graceful stop on SIGTERM (omni_trainer.components.graceful_stop),
also what a container killed by SIGTERM reports: stopped on request, not a crash."""
GRACEFUL_REASONS = frozenset({"PodDeleted", "PodEvicted", "GracefulStop", "Straggler"})
"""Failures of an attempt that was asked to stop with a grace period: its trainers write an
emergency checkpoint, so the next attempt waits for the old pods to be gone (a straggler's
replacement deletes the pods with their grace)."""

_DISRUPTIONS = {
    "EvictionByEvictionAPI",
    "PreemptionByScheduler",
    "DeletionByTaintManager",
    "TerminationByKubelet",
}


@dataclass(frozen=True)
class Failure:
    """One classified failure of the current attempt."""

    kind: FailureKind
    message: str
    """In words, naming pods, nodes and exit codes: it goes to status and an Event."""
    nodes: tuple[str, ...] = ()
    """Nodes involved (a hot spare replaces a lost one); quarantine counts them only for the
    reasons that blame nodes (:func:`failure_origin.blames_nodes`)."""
    pods: tuple[str, ...] = ()
    exit_code: int | None = None
    preflight: Mapping[str, Any] | None = None
    """The trainers' network preflight result, when that is what failed."""

    @property
    def reason(self) -> str:
        return REASONS[self.kind]

    @property
    def retryable(self) -> bool:
        return self.kind not in ("user_error", "image_pull_failed")


def pod_node(pod: Obj, placement: Sequence[str] = ()) -> str | None:
    """The node a pod runs on: scheduled (``spec.nodeName``), else where it was placed."""
    name = (pod.get("spec") or {}).get("nodeName")
    if name:
        return str(name)
    meta = pod.get("metadata") or {}
    placed = (meta.get("annotations") or {}).get(ANNOTATION_NODE)
    if placed:
        return str(placed)
    rank = pod_rank(pod)
    return placement[rank] if rank is not None and rank < len(placement) else None


def pod_rank(pod: Obj) -> int | None:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK)
    return int(value) if value is not None and str(value).isdigit() else None


def node_not_ready_since(node: Obj, now: dt.datetime) -> dt.datetime | None:
    """When the node stopped being Ready (None: it is Ready). A NotReady/Unknown condition
    without a transition time counts as "since ever": the grace cannot be measured."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") == "True":
        return None
    since = parse_time((ready or {}).get("lastTransitionTime"))
    return since or dt.datetime.min.replace(tzinfo=dt.UTC)


def node_lost(
    name: str | None, nodes: Mapping[str, Obj], *, spec: OmniTrainingJobSpec, now: dt.datetime
) -> str | None:
    """Why the node counts as lost (missing, or NotReady longer than the grace), or None."""
    if name is None:
        return None
    node = nodes.get(name)
    if node is None:
        return f"node {name} no longer exists"
    since = node_not_ready_since(node, now)
    if since is None:
        return None
    grace = spec.restart_policy.node_lost_grace_seconds
    waited = (now - since).total_seconds()
    if waited < grace:
        return None
    state = _ready_status(node)
    if since.year == 1:
        return f"node {name} is {state} (nodeLostGraceSeconds {grace})"
    return f"node {name} is {state} for {waited:.0f} s (nodeLostGraceSeconds {grace})"


def _ready_status(node: Obj) -> str:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None:
        return "without a Ready condition"
    return "unreachable (Ready=Unknown)" if ready.get("status") == "Unknown" else "NotReady"


@dataclass(frozen=True)
class _Exit:
    pod: str
    node: str | None
    rank: int | None
    code: int | None
    reason: str
    finished: dt.datetime | None
    message: str = ""
    """The container's termination message (the trainer's fatal error, or its log's tail)."""


@dataclass(frozen=True)
class Current:
    """Which container terminations belong to the running attempt (in-place restarts keep
    pods whose containers ended in earlier attempts)."""

    attempt: int = 0
    kept_since: dt.datetime | None = None
    """When the attempt started in pods kept from an earlier attempt (an in-place restart);
    None: the pods are the attempt's own, so every termination in them is the attempt's."""


def _older(term: Obj, current: Current) -> bool:
    """An untagged termination (the whole container was killed, its supervisor with it) in a
    kept pod that ended no later than the attempt's start. Timestamps have whole seconds, so
    one in the start's own second counts as older: the operator saw it before it started the
    attempt (counting it again restarted the job once more for the same kill). A new failure
    that early only delays detection: the kubelet restarts the container into the attempt, and
    its peers' trainers fail tagged with the attempt."""
    if current.kept_since is None:
        return False
    finished = parse_time(term.get("finishedAt"))
    return finished is not None and finished <= current.kept_since


REPORTED = f"{GROUP}/reported"
"""In a container's status as the operator observed it (never in the API): the failed attempt
its pod's supervisor reported over HTTP (``omni_trainer.failure_report``) while the container
runs on. It counts as that container's termination would."""


def with_reports(pods: Sequence[Obj], reports: Mapping[str, Obj]) -> list[Obj]:
    """``pods`` with each supervisor's report (pod name -> failure) in the status of the pod's
    first container, the trainer's (:data:`REPORTED`); the others as they are."""
    out: list[Obj] = []
    for pod in pods:
        doc = reports.get((pod.get("metadata") or {}).get("name", ""))
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        if doc is None or not statuses or pod.get("kind", "Pod") != "Pod":
            out.append(pod)
            continue
        first = {**statuses[0], REPORTED: dict(doc)}
        status = {**pod["status"], "containerStatuses": [first, *statuses[1:]]}
        out.append({**pod, "status": status})
    return out


def _ends(cs: Obj) -> Iterable[Obj]:
    """A container's ends as observed: ``state``, ``lastState`` (the kubelet restarted it), and
    its supervisor's report (it runs on)."""
    for key in ("state", "lastState"):
        term = (cs.get(key) or {}).get("terminated")
        if term:
            yield term
    if cs.get(REPORTED):
        yield cs[REPORTED]


def _termination(cs: Obj, current: Current) -> Obj | None:
    """The container's latest failed termination of the current attempt: its ``state`` or,
    once the kubelet restarted it, its ``lastState``, or its supervisor's report. A message
    tagged ``[attempt N]`` (by the in-pod supervisor) with N older than the attempt is an echo
    of a handled failure."""
    for term in _ends(cs):
        if term.get("exitCode", 0) == 0:
            continue
        tagged, _ = untag(term.get("message") or "")
        if (tagged < current.attempt) if tagged is not None else _older(term, current):
            continue
        return term
    return None


def _terminated(pod: Obj, placement: Sequence[str], current: Current) -> _Exit | None:
    """The pod's failure, if it failed: phase Failed or a container terminated non-zero in the
    current attempt (also one the kubelet already restarted in place)."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "?")
    code: int | None = None
    reason = status.get("reason") or ""
    finished: dt.datetime | None = None
    message = ""
    for cs in status.get("containerStatuses") or []:
        term = _termination(cs, current)
        if term is not None:
            code = int(term["exitCode"])
            reason = term.get("reason") or reason
            finished = parse_time(term.get("finishedAt"))
            message = untag(term.get("message") or "")[1].strip()
            break
    if status.get("phase") != "Failed" and code is None:
        return None
    node, rank = pod_node(pod, placement), pod_rank(pod)
    return _Exit(name, node, rank, code, reason, finished, message)


def _evicted(pod: Obj) -> str | None:
    status = pod.get("status") or {}
    if status.get("phase") == "Failed" and status.get("reason") in ("Evicted", "Preempting"):
        return str(status.get("message") or status["reason"])
    for c in status.get("conditions") or []:
        disrupted = c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        if disrupted and c.get("reason") in _DISRUPTIONS:
            return str(c.get("message") or c["reason"])
    return None


_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CREATE_REASONS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
_IMAGE_MISSING = re.compile(
    r"not found|manifest unknown|NotFound|repository does not exist|pull access denied", re.I
)


@dataclass(frozen=True)
class StartIssue:
    """Why one pod of an attempt does not run yet, as the scheduler or the kubelet says it."""

    pod: str
    reason: str
    """Unschedulable, ErrImagePull, ImagePullBackOff, InvalidImageName, CreateContainerError..."""
    message: str
    image: str | None = None

    @property
    def terminal(self) -> bool:
        """Waiting cannot help: the image does not exist (or its name is invalid)."""
        if self.reason in ("InvalidImageName", "ErrImageNeverPull"):
            return True
        return self.reason in _PULL_REASONS and bool(_IMAGE_MISSING.search(self.message))

    def describe(self) -> str:
        what = f" (image {self.image})" if self.image and self.reason in _PULL_REASONS else ""
        return f"pod {self.pod}: {self.reason}{what}" + (
            f": {self.message}" if self.message else ""
        )


def start_issues(pods: Sequence[Obj]) -> list[StartIssue]:
    """What keeps pods from running: the scheduler's Unschedulable condition, or a container
    waiting on an image pull or on its creation (by pod name)."""
    out = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        status = pod.get("status") or {}
        if status.get("phase") not in (None, "", "Pending"):
            continue
        images = {
            c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []
        }
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason") or ""
            if reason in _PULL_REASONS | _CREATE_REASONS:
                image = cs.get("image") or images.get(cs.get("name"))
                out.append(StartIssue(name, reason, str(waiting.get("message") or ""), image))
                break
        else:
            for c in status.get("conditions") or []:
                if c.get("type") == "PodScheduled" and c.get("status") == "False":
                    reason = c.get("reason") or "Unschedulable"
                    out.append(StartIssue(name, reason, str(c.get("message") or "")))
    return out


def classify(
    pods: Sequence[Obj],
    nodes: Mapping[str, Obj],
    *,
    spec: OmniTrainingJobSpec,
    now: dt.datetime,
    last_progress_time: dt.datetime | None,
    started_steps: bool | None,
    placement: Sequence[str] = (),
    starting_since: dt.datetime | None = None,
    current: Current = Current(),
) -> Failure | None:
    """The failure of the current attempt, or None while it is healthy (or still pending).

    Args:
        pods: the pods of the current attempt (one per node rank when complete).
        nodes: every Node by name (a missing node counts as lost).
        spec: the job's spec (restart policy, expected pod count).
        now: the time of the observation.
        last_progress_time: when the training step last advanced (or the attempt started);
            None disables hang detection (no progress source).
        started_steps: whether the job has ever finished a training step; None when unknown
            (then a crash is never taken for a user error).
        placement: node names by node rank (for pods that are gone or not yet scheduled).
        starting_since: when the attempt's pods were created, while it has not reached its
            first step (None: it has, or no start timeout applies).
        current: the running attempt, to tell its container failures from older ones.

    Returns:
        The most fundamental failure, or None.
    """
    policy = spec.restart_policy
    live, exits = _live_and_exits(pods, placement, current)

    # 1. Lost nodes: pods on them cannot report, and their peers fail as a consequence. A node
    #    still within its grace counts as lost as soon as a peer fails: the attempt is over
    #    anyway, and the blame (quarantine) belongs to the node that went away, not the peer.
    lost: dict[str, str] = {}
    unready: dict[str, str] = {}
    for pod in pods:
        node = pod_node(pod, placement)
        why = node_lost(node, nodes, spec=spec, now=now)
        if node and why:
            lost[node] = why
        elif node and node in nodes and node_not_ready_since(nodes[node], now) is not None:
            unready[node] = f"node {node} is {_ready_status(nodes[node])}"
    if unready and exits:
        lost.update({n: f"{why} and its peers failed" for n, why in unready.items()})
    if lost:
        names = tuple(sorted(lost))
        return Failure(
            "node_lost",
            "; ".join(lost[n] for n in names),
            nodes=names,
            pods=_pods_on(pods, names, placement),
        )

    # 2. Evictions (node pressure, preemption, taint manager): the node or the cluster's fault.
    for pod in live:
        why = _evicted(pod)
        if why:
            name = pod["metadata"]["name"]
            node = pod_node(pod, placement)
            return Failure(
                "pod_evicted",
                f"pod {name} on node {node} was evicted: {why}",
                nodes=(node,) if node else (),
                pods=(name,),
            )

    # 3. Failed pods: a non-retryable exit code, a crash before any step, or a plain failure.
    preflight = _preflight_failure(exits)
    if preflight is not None:
        return preflight
    if exits:
        for e in exits:
            if e.code is not None and e.code in policy.non_retryable_exit_codes:
                return Failure(
                    "user_error",
                    f"pod {e.pod} (node rank {e.rank}) exited with code {e.code}, which "
                    "restartPolicy.nonRetryableExitCodes lists: not restarted"
                    + (f": {e.message}" if e.message else ""),
                    pods=(e.pod,),
                    exit_code=e.code,
                )
        if all(e.code == EXIT_STOPPED for e in exits):
            names = tuple(e.pod for e in exits)
            return Failure(
                "stopped",
                f"pod{'s' if len(names) > 1 else ''} {', '.join(names)} stopped on SIGTERM "
                f"(exit code {EXIT_STOPPED}): the trainers stopped together, after an emergency "
                "checkpoint if the grace allowed",
                pods=names,
                exit_code=EXIT_STOPPED,
            )
        if _cause_due(exits, live, now) is not None:
            return None
        first = _first_failures(exits)
        e = first[0]
        what = f"exit code {e.code}" if e.code is not None else "no exit code"
        detail = f"{what}{f', {e.reason}' if e.reason else ''}"
        cause = next((f": {x.message}" for x in first + exits if x.message), "")
        more = f" ({len(exits) - 1} more pods failed after it)" if len(exits) > 1 else ""
        if (origin := _origin(e, first, more, cause)) is not None:
            return origin
        if started_steps is False:
            return Failure(
                "user_error",
                f"pod {e.pod} (node rank {e.rank}) failed ({detail}) before the first training "
                f"step: a configuration or code error, not restarted{cause}",
                pods=tuple(x.pod for x in first),
                exit_code=e.code,
            )
        return Failure(
            "pod_failed",
            f"pod {e.pod} (node rank {e.rank}) on node {e.node} failed ({detail}){more}{cause}",
            nodes=tuple(sorted({x.node for x in first if x.node})),
            pods=tuple(x.pod for x in first),
            exit_code=e.code,
        )

    # 4. An image that does not exist: no restart can help.
    issues = start_issues(live)
    for issue in issues:
        if issue.terminal:
            return Failure(
                "image_pull_failed",
                f"image {issue.image} cannot be pulled: {issue.describe()}; fix spec.image",
                pods=(issue.pod,),
            )

    # 5. Pods that are gone or going while the job needs them.
    #    Pods the scheduler places have no rank until all are bound: counted, not named.
    present = {pod_rank(p) for p in live}
    unranked = sum(pod_rank(p) is None for p in live)
    missing = [r for r in range(spec.nodes) if r not in present][unranked:]
    if missing:
        deleting = sorted(
            p["metadata"]["name"]
            for p in pods
            if (p.get("metadata") or {}).get("deletionTimestamp")
        )
        ranks = ", ".join(map(str, missing))
        how = f" ({', '.join(deleting)} being deleted)" if deleting else ""
        many = len(missing) > 1
        what = (
            f"{len(missing)} of the {spec.nodes} pods"
            if unranked
            else f"the pod{'s' if many else ''} of node rank{'s' if many else ''} {ranks}"
        )
        return Failure(
            "pod_deleted", f"{what} {'are' if many else 'is'} gone{how}", pods=tuple(deleting)
        )

    # 6. A start that takes too long: pods unschedulable, pulls failing, or no first step.
    if starting_since is not None:
        waited = (now - starting_since).total_seconds()
        if waited > policy.start_timeout_seconds:
            why = "; ".join(i.describe() for i in issues) or "the trainer reported no step yet"
            return Failure(
                "start_timeout",
                f"attempt not started {waited:.0f} s after its pods were created "
                f"(startTimeoutSeconds {policy.start_timeout_seconds}): {why}",
                pods=tuple(i.pod for i in issues),
            )

    # 7. A hang: every pod runs, yet the step has not advanced within the timeout.
    if last_progress_time is not None and all(
        (p.get("status") or {}).get("phase") == "Running" for p in live
    ):
        idle = (now - last_progress_time).total_seconds()
        if idle > policy.hang_timeout_seconds:
            return Failure(
                "hang",
                f"no training step progress for {idle:.0f} s (hangTimeoutSeconds "
                f"{policy.hang_timeout_seconds}); last progress at "
                f"{format_time(last_progress_time)}",
                pods=tuple(sorted(p["metadata"]["name"] for p in live)),
            )
    return None


def _origin(e: _Exit, first: list[_Exit], more: str, cause: str) -> Failure | None:
    """A failure that is not the trainer's own, at any step: a container lost with its state or
    node, killed from outside, or a device or fabric error of its node (blamed). None: the
    trainer's own crash."""
    head = f"pod {e.pod} (node rank {e.rank}) on node {e.node}"
    why = infrastructure_cause(e.code, e.reason, e.message)
    if why is not None:
        kind: FailureKind = "container_lost" if e.reason in LOST_REASONS else "pod_failed"
        return Failure(
            kind,
            f"{head} {why}{more}: an infrastructure failure, not the trainer's; restarting{cause}",
            nodes=tuple(sorted({x.node for x in first if x.node})),
            pods=tuple(x.pod for x in first),
            exit_code=e.code,
        )
    found = [(x, err) for x in first if (err := device_error(x.message)) is not None]
    if found:
        return Failure(
            "device_error",
            f"{head} failed with a device or fabric error{more}: {found[0][1]}",
            nodes=tuple(sorted({x.node for x, _ in found if x.node})),
            pods=tuple(x.pod for x, _ in found),
            exit_code=e.code,
        )
    return None


def _preflight_failure(exits: list[_Exit]) -> Failure | None:
    """The trainers' network preflight failed: the nodes any pod named (a silent node is named
    by its neighbours only). Nodes are blamed only when the check could tell which (with two
    nodes one slow link names both: no quarantine, the restart is charged)."""
    found = [(e, doc) for e in exits if (doc := parse_failure(e.message)) is not None]
    if not found:
        return None
    named = sorted({n for _, doc in found for n in doc.get("failed") or []})
    blamed = tuple(n for n in named if all(doc.get("attributed", True) for _, doc in found))
    figures = next((doc.get("nodes") for _, doc in found if doc.get("complete")), {}) or {}
    said = ", ".join(
        f"{n} {'no answer' if figures.get(n) is None else f'{figures[n]:.3g} GB/s'}" for n in named
    )
    return Failure(
        "preflight_failed",
        f"network preflight failed on node{'s' if len(named) != 1 else ''} "
        f"{', '.join(named) or '(none named)'} ({said or 'a peer stopped answering'}): "
        + ("replacing them" if blamed else "the slow side cannot be told, restarting"),
        nodes=blamed,
        pods=tuple(e.pod for e, _ in found),
        exit_code=found[0][0].code,
        preflight=next((doc for _, doc in found if doc.get("complete")), found[0][1]),
    )


def next_deadline(
    pods: Sequence[Obj],
    nodes: Mapping[str, Obj],
    *,
    spec: OmniTrainingJobSpec,
    now: dt.datetime,
    last_progress_time: dt.datetime | None,
    placement: Sequence[str] = (),
    starting_since: dt.datetime | None = None,
    current: Current = Current(),
) -> float | None:
    """Seconds until a healthy-looking attempt could turn failed with no event to say so: a
    NotReady node's grace ends, the start or the hang timeout passes, the wait for the crash a
    peer's failure follows ends. None when nothing is pending."""
    policy = spec.restart_policy
    due: list[float] = []
    live, exits = _live_and_exits(pods, placement, current)
    if exits and (cause := _cause_due(exits, live, now)) is not None:
        due.append(cause)
    for pod in pods:
        node = nodes.get(pod_node(pod, placement) or "")
        since = node_not_ready_since(node, now) if node is not None else None
        if since is not None and since.year > 1:
            due.append(policy.node_lost_grace_seconds - (now - since).total_seconds())
    if last_progress_time is not None:
        due.append(policy.hang_timeout_seconds - (now - last_progress_time).total_seconds())
    if starting_since is not None:
        due.append(policy.start_timeout_seconds - (now - starting_since).total_seconds())
    return max(min(due), 0.0) if due else None


def _pods_on(
    pods: Sequence[Obj], nodes: Iterable[str], placement: Sequence[str]
) -> tuple[str, ...]:
    wanted = set(nodes)
    return tuple(sorted(p["metadata"]["name"] for p in pods if pod_node(p, placement) in wanted))


AFTER_A_PEER = re.compile(
    r"connection (?:closed|reset) by peer|remote worker (?:crash|hang)|remote process exited"
    r"|communicator was aborted|ncclRemoteError|DistNetworkError|broken pipe",
    re.IGNORECASE,
)
"""A trainer's fatal error that says another process went first: a collective or the store
lost its peer (gloo, NCCL, torch.distributed). Such a failure follows a cause elsewhere."""


PEER_REPORT_GRACE_S = 10.0
"""How long failures that all say a peer went first wait for a pod that has not reported yet:
the crash they follow is its own report, a moment later."""


def _live_and_exits(
    pods: Sequence[Obj], placement: Sequence[str], current: Current
) -> tuple[list[Obj], list[_Exit]]:
    """The pods not being deleted, and the failures among them (:func:`_terminated`)."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    exits = [e for e in (_terminated(p, placement, current) for p in live) if e is not None]
    return live, exits


def _cause_due(exits: list[_Exit], live: Sequence[Obj], now: dt.datetime) -> float | None:
    """Seconds left to wait for the crash the failures follow, or None: they wait while every
    failed pod says a peer went first, a pod of the attempt has not failed (yet), and the first
    failure is under :data:`PEER_REPORT_GRACE_S` old. Classifying sooner would blame a
    bystander: its trainer can end within milliseconds of the crash, before the crashed pod's
    failure is reported."""
    if len(exits) >= len(live) or not all(AFTER_A_PEER.search(e.message) for e in exits):
        return None
    times = [e.finished for e in exits if e.finished is not None]
    left = PEER_REPORT_GRACE_S - (now - min(times)).total_seconds() if times else 0.0
    return left if left > 0 else None


def _first_failures(exits: list[_Exit]) -> list[_Exit]:
    """The pods that failed first (their peers then fail on broken collectives): among those
    whose error does not say a peer went first (all, when every one says so), the earliest
    ``finishedAt``, all of them on a tie; without times, every such pod, by rank. Times have
    whole seconds, and a peer's error can end its trainer within milliseconds of the crash it
    follows: the time alone blames the wrong node about as often as the right one."""
    exits = [e for e in exits if not AFTER_A_PEER.search(e.message)] or exits
    timed = [e for e in exits if e.finished is not None]
    if not timed:
        return sorted(exits, key=lambda e: (e.rank is None, e.rank or 0))
    first = min(e.finished for e in timed if e.finished is not None)
    return sorted(
        (e for e in timed if e.finished == first), key=lambda e: (e.rank is None, e.rank or 0)
    )


RestartMode = Literal["in-place", "recreate", "spare"]
IN_PLACE_KINDS = frozenset({"pod_failed", "hang"})
"""Failures whose pods are all still there and healthy but for their trainer: restarted inside
them. A lost node, an eviction, a deleted pod or a stuck start need new pods."""


def restart_mode(failure: Failure, pods: Sequence[Obj], spec: OmniTrainingJobSpec) -> RestartMode:
    """In place when the policy allows it and every pod of the attempt still runs (a crashed
    container is restarted by the kubelet under ``restartPolicy: OnFailure``), else recreate."""
    if spec.restart_policy.mode != "in-place" or failure.kind not in IN_PLACE_KINDS:
        return "recreate"
    alive = [
        p
        for p in pods
        if not (p.get("metadata") or {}).get("deletionTimestamp")
        and (p.get("status") or {}).get("phase") == "Running"
    ]
    return "in-place" if len(alive) == spec.nodes == len(pods) else "recreate"


RECREATE_OVER_BACKOFF_S = 15.0
"""An in-place restart recreates the pods instead when a container of theirs waits longer than
this in the kubelet's CrashLoopBackOff (10 s, 20 s, ... 5 min for a container crashing again
within 10 minutes): new pods start without one."""
_BACKOFF = re.compile(r"back-off (\S+) restarting")
_GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


def go_duration_seconds(text: str) -> float | None:
    """A Go ``time.Duration`` as the kubelet prints it (``40s``, ``2m40s``, ``5m0s``)."""
    m = _GO_DURATION.match(text)
    if not text or m is None:
        return None
    h, mins, secs = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mins * 60 + secs


def backoff_left(pod: Obj, now: dt.datetime) -> float:
    """Seconds until the kubelet restarts a container of ``pod`` that waits in
    ``CrashLoopBackOff`` (its back-off counts from the container's end); 0 when none waits."""
    left = 0.0
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        m = _BACKOFF.search(waiting.get("message") or "")
        ended = parse_time(((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
        delay = go_duration_seconds(m.group(1)) if m else None
        if waiting.get("reason") == "CrashLoopBackOff" and delay is not None and ended is not None:
            left = max(left, (ended - now).total_seconds() + delay)
    return left


@dataclass(frozen=True)
class Decision:
    """What to do about a failure."""

    action: Literal["restart", "fail"]
    reason: str
    """CamelCase: the failure's reason for a restart; for failing, the failure's reason or
    RestartBudgetExhausted."""
    message: str
    delay_seconds: float = 0.0
    """Backoff before the next attempt's pods are created."""
    restart_at: dt.datetime | None = None
    budget_left: int = 0
    """Restarts left without progress after this decision."""
    quarantine: tuple[str, ...] = ()
    """Every node to avoid from now on (including earlier quarantines)."""
    from_step: int | None = None
    """The checkpoint step the next attempt resumes from (None: from scratch)."""
    record: RestartRecord | None = field(default=None, compare=False)
    """The history entry of a restart."""


def backoff_seconds(restart: int, spec: OmniTrainingJobSpec) -> float:
    """Delay before restart number ``restart`` (1-based) without progress:
    ``min(base * 2**(restart-1), max)``."""
    b = spec.restart_policy.backoff_seconds
    return float(min(b.base * 2 ** max(restart - 1, 0), b.max))


def restarts_without_progress(
    history: Sequence[RestartRecord], latest_checkpoint_step: int | None
) -> int:
    """How many of the latest restarts resumed from the checkpoint that is still the latest:
    a newer checkpoint since the last restart resets the count to zero."""
    used = 0
    for record in reversed(history):
        if record.from_step != latest_checkpoint_step:
            break
        used += not is_free(record.reason, record.nodes)
    return used


def is_free(reason: str, nodes: Sequence[str]) -> bool:
    """A preflight that named its nodes replaced them before any step: its restart spends no
    budget (each quarantines a node, so the cluster's size bounds them)."""
    return reason == "PreflightFailed" and bool(nodes)


def quarantined_nodes(
    history: Sequence[RestartRecord],
    failure: Failure | None,
    *,
    policy: RestartPolicyConfig,
    now: dt.datetime,
    already: Iterable[str] = (),
) -> tuple[str, ...]:
    """The nodes to avoid after ``failure``: those already quarantined, plus the ones its
    node-attributable failures within the window put there (:func:`quarantine.to_quarantine`),
    sorted."""
    new = (
        ()
        if failure is None
        else to_quarantine(history, failure.reason, failure.nodes, policy=policy, now=now)
    )
    return tuple(sorted(set(already) | set(new)))


def decide_restart(
    history: Sequence[RestartRecord],
    failure: Failure,
    spec: OmniTrainingJobSpec,
    now: dt.datetime,
    latest_checkpoint_step: int | None,
    *,
    attempt: int = 0,
    quarantined: Iterable[str] = (),
    reached_step: int | None = None,
    mode: RestartMode = "recreate",
) -> Decision:
    """Restart the whole job from the latest checkpoint after a backoff, or fail it.

    Args:
        history: earlier restarts, oldest first.
        failure: what :func:`classify` found.
        spec: the job's spec (budget, backoff, quarantine threshold).
        now: decision time.
        latest_checkpoint_step: the newest complete checkpoint (None: none yet).
        attempt: the attempt that failed; a restart runs ``attempt + 1``.
        quarantined: nodes quarantined before.
        reached_step: the last step the failed attempt reported (steps recomputed).
        mode: how the restart happens (:func:`restart_mode`), for the record and message.

    Returns:
        The decision; for a restart, ``record`` is the entry to append to the history.
    """
    policy = spec.restart_policy
    quarantine = quarantined_nodes(history, failure, policy=policy, now=now, already=quarantined)
    used = restarts_without_progress(history, latest_checkpoint_step)
    charge = 0 if is_free(failure.reason, failure.nodes) else 1
    if not failure.retryable:
        return Decision(
            "fail",
            failure.reason,
            failure.message,
            budget_left=max(policy.budget - used, 0),
            quarantine=quarantine,
            from_step=latest_checkpoint_step,
        )
    if charge and used >= policy.budget:
        since = (
            f"checkpoint step {latest_checkpoint_step}"
            if latest_checkpoint_step is not None
            else "the start (no checkpoint yet)"
        )
        return Decision(
            "fail",
            "RestartBudgetExhausted",
            f"restart budget exhausted: {used} restart{'s' if used != 1 else ''} from {since} "
            f"without a newer checkpoint (restartPolicy.budget {policy.budget}); last failure: "
            f"{failure.reason}: {failure.message}",
            budget_left=0,
            quarantine=quarantine,
            from_step=latest_checkpoint_step,
        )
    delay = backoff_seconds(used + 1, spec)
    # The trainer resumes from the newest checkpoint in storage, which may be newer than the last
    # one the operator saw; the ResumedFrom Event and restartHistory then give the actual step.
    resume = (
        f"the newest checkpoint (step {latest_checkpoint_step} or newer)"
        if latest_checkpoint_step is not None
        else "the newest checkpoint (none seen yet: the start if none is written)"
    )
    new_q = sorted(set(quarantine) - set(quarantined))
    how = {"in-place": " in place", "spare": " on a hot spare"}.get(mode, "")
    left = max(policy.budget - used - charge, 0)
    message = (
        f"{failure.message}; restarting{how} as attempt {attempt + 1} from {resume} in {delay:g} s "
        f"({left} of {policy.budget} restarts left without progress)"
        + (f"; quarantined node{'s' if len(new_q) > 1 else ''} {', '.join(new_q)}" if new_q else "")
    )
    record = RestartRecord(
        attempt=attempt + 1,
        reason=failure.reason,
        message=failure.message,
        time=format_time(now),
        nodes=list(failure.nodes),
        from_step=latest_checkpoint_step,
        delay_seconds=delay,
        mode=mode,
        reached_step=reached_step,
        # A graceful stop may write a newer checkpoint than the operator knows of: unknown
        # until the trainer reports the step it resumed from (RestartRecord.resumed).
        steps_recomputed=(
            max(reached_step - (latest_checkpoint_step or 0), 0)
            if reached_step is not None and failure.reason not in GRACEFUL_REASONS
            else None
        ),
    )
    return Decision(
        "restart",
        failure.reason,
        message,
        delay_seconds=delay,
        restart_at=now + dt.timedelta(seconds=delay),
        budget_left=left,
        quarantine=quarantine,
        from_step=latest_checkpoint_step,
        record=record,
    )
