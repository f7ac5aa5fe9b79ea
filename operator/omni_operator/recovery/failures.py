"""Failure classification: what went wrong with a running attempt (pure functions).

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

A container the kubelet restarted in place keeps its end in ``lastState``: :class:`Current`
tells this attempt's ends from older ones. :func:`next_deadline` says when a healthy-looking
attempt could turn failed with no event to say so.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from omni_operator.failure_origin import LOST_REASONS, device_error, infrastructure_cause
from omni_operator.kube_objects import (
    Obj,
    node_not_ready_since,
    node_ready_status,
    pod_node,
    pod_rank,
)
from omni_operator.spec import GROUP, OmniTrainingJobSpec, RestartPolicyConfig
from omni_operator.times import format_time, parse_time
from omni_trainer.distributed.netcheck_rules import parse_failure
from omni_trainer.pod_protocol import untag

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
    state = node_ready_status(node)
    if since.year == 1:
        return f"node {name} is {state} (nodeLostGraceSeconds {grace})"
    return f"node {name} is {state} for {waited:.0f} s (nodeLostGraceSeconds {grace})"


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

    The steps run from the most fundamental cause to the least (see the module docstring); the
    first that finds a failure names it.

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
    lost = _lost_nodes(
        pods, nodes, spec=spec, now=now, placement=placement, peers_failed=bool(exits)
    )
    if lost is not None:
        return lost
    evicted = _eviction(live, placement)
    if evicted is not None:
        return evicted
    if exits:
        return _failed_pods(exits, live, policy=policy, now=now, started_steps=started_steps)
    issues = start_issues(live)
    return (
        _missing_image(issues)
        or _missing_pods(pods, live, spec)
        or _start_timeout(issues, starting_since, policy=policy, now=now)
        or _hang(live, last_progress_time, policy=policy, now=now)
    )


def _lost_nodes(
    pods: Sequence[Obj],
    nodes: Mapping[str, Obj],
    *,
    spec: OmniTrainingJobSpec,
    now: dt.datetime,
    placement: Sequence[str],
    peers_failed: bool,
) -> Failure | None:
    """Lost nodes: pods on them cannot report, and their peers fail as a consequence. A node
    still within its grace counts as lost as soon as a peer fails: the attempt is over anyway,
    and the blame (quarantine) belongs to the node that went away, not the peer."""
    lost: dict[str, str] = {}
    unready: dict[str, str] = {}
    for pod in pods:
        node = pod_node(pod, placement)
        why = node_lost(node, nodes, spec=spec, now=now)
        if node and why:
            lost[node] = why
        elif node and node in nodes and node_not_ready_since(nodes[node], now) is not None:
            unready[node] = f"node {node} is {node_ready_status(nodes[node])}"
    if unready and peers_failed:
        lost.update({n: f"{why} and its peers failed" for n, why in unready.items()})
    if not lost:
        return None
    names = tuple(sorted(lost))
    return Failure(
        "node_lost",
        "; ".join(lost[n] for n in names),
        nodes=names,
        pods=_pods_on(pods, names, placement),
    )


def _eviction(live: Sequence[Obj], placement: Sequence[str]) -> Failure | None:
    """An eviction (node pressure, preemption, taint manager): the node or the cluster's fault."""
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
    return None


def _failed_pods(
    exits: list[_Exit],
    live: Sequence[Obj],
    *,
    policy: RestartPolicyConfig,
    now: dt.datetime,
    started_steps: bool | None,
) -> Failure | None:
    """Failed pods: a failed network preflight, a non-retryable exit code, a graceful stop, or
    a crash (None: the failures wait for the crash they follow, :func:`_cause_due`)."""
    preflight = _preflight_failure(exits)
    if preflight is not None:
        return preflight
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
    return _crash(exits, started_steps=started_steps)


def _crash(exits: list[_Exit], *, started_steps: bool | None) -> Failure:
    """The failure of the pods that failed first: infrastructure (:func:`_origin`), a
    configuration or code error before the first step, or a crash to restart."""
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


def _missing_image(issues: Sequence[StartIssue]) -> Failure | None:
    """An image that does not exist: no restart can help."""
    for issue in issues:
        if issue.terminal:
            return Failure(
                "image_pull_failed",
                f"image {issue.image} cannot be pulled: {issue.describe()}; fix spec.image",
                pods=(issue.pod,),
            )
    return None


def _missing_pods(
    pods: Sequence[Obj], live: Sequence[Obj], spec: OmniTrainingJobSpec
) -> Failure | None:
    """Pods that are gone or going while the job needs them. Pods the scheduler places have no
    rank until all are bound: counted, not named."""
    present = {pod_rank(p) for p in live}
    unranked = sum(pod_rank(p) is None for p in live)
    missing = [r for r in range(spec.nodes) if r not in present][unranked:]
    if not missing:
        return None
    deleting = sorted(
        p["metadata"]["name"] for p in pods if (p.get("metadata") or {}).get("deletionTimestamp")
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


def _start_timeout(
    issues: Sequence[StartIssue],
    starting_since: dt.datetime | None,
    *,
    policy: RestartPolicyConfig,
    now: dt.datetime,
) -> Failure | None:
    """A start that takes too long: pods unschedulable, pulls failing, or no first step."""
    if starting_since is None:
        return None
    waited = (now - starting_since).total_seconds()
    if waited <= policy.start_timeout_seconds:
        return None
    why = "; ".join(i.describe() for i in issues) or "the trainer reported no step yet"
    return Failure(
        "start_timeout",
        f"attempt not started {waited:.0f} s after its pods were created "
        f"(startTimeoutSeconds {policy.start_timeout_seconds}): {why}",
        pods=tuple(i.pod for i in issues),
    )


def _hang(
    live: Sequence[Obj],
    last_progress_time: dt.datetime | None,
    *,
    policy: RestartPolicyConfig,
    now: dt.datetime,
) -> Failure | None:
    """A hang: every pod runs, yet the step has not advanced within the timeout."""
    if last_progress_time is None or not all(
        (p.get("status") or {}).get("phase") == "Running" for p in live
    ):
        return None
    idle = (now - last_progress_time).total_seconds()
    if idle <= policy.hang_timeout_seconds:
        return None
    return Failure(
        "hang",
        f"no training step progress for {idle:.0f} s (hangTimeoutSeconds "
        f"{policy.hang_timeout_seconds}); last progress at {format_time(last_progress_time)}",
        pods=tuple(sorted(p["metadata"]["name"] for p in live)),
    )


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
