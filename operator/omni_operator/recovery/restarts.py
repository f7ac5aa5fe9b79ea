"""Restart decisions: what to do about a classified failure (pure functions).

:func:`decide_restart` turns a failure into a decision: a whole-job restart after exponential
backoff, or failing the job (a user error, or the restart budget is spent). :func:`restart_mode`
says how: with ``restartPolicy.mode: in-place`` a crashed or hung trainer whose pods all still
run restarts inside them (the pods' supervisors start the new attempt); pods that are gone, or
``mode: recreate``, mean new pods. The budget counts restarts *without progress*: a checkpoint
newer than the one the last restart resumed from refills it, so a week-long job survives many
unrelated failures while a crash loop stops soon.

Nodes blamed for node-attributable failures are quarantined (:func:`quarantined_nodes`) once
they reach ``restartPolicy.quarantineAfterFailures`` within ``quarantineSeconds``, and placement
avoids them until :mod:`omni_operator.quarantine` lifts them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from omni_operator.kube_objects import Obj
from omni_operator.quarantine import to_quarantine
from omni_operator.recovery.failures import GRACEFUL_REASONS, Failure
from omni_operator.spec import OmniTrainingJobSpec, RestartPolicyConfig
from omni_operator.status import RestartRecord
from omni_operator.times import format_time

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
        failure: what :func:`~omni_operator.recovery.failures.classify` found.
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
        return _budget_exhausted(failure, used, policy, latest_checkpoint_step, quarantine)
    delay = backoff_seconds(used + 1, spec)
    left = max(policy.budget - used - charge, 0)
    new_q = sorted(set(quarantine) - set(quarantined))
    message = _restart_message(
        failure,
        attempt=attempt,
        mode=mode,
        delay=delay,
        left=left,
        budget=policy.budget,
        latest_checkpoint_step=latest_checkpoint_step,
        new_quarantine=new_q,
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
        steps_recomputed=_steps_recomputed(failure, reached_step, latest_checkpoint_step),
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


def _budget_exhausted(
    failure: Failure,
    used: int,
    policy: RestartPolicyConfig,
    latest_checkpoint_step: int | None,
    quarantine: tuple[str, ...],
) -> Decision:
    """Fail the job: ``used`` restarts without a newer checkpoint spent the budget."""
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


def _restart_message(
    failure: Failure,
    *,
    attempt: int,
    mode: RestartMode,
    delay: float,
    left: int,
    budget: int,
    latest_checkpoint_step: int | None,
    new_quarantine: Sequence[str],
) -> str:
    """The restart in words: how, as which attempt, from where, when, the budget left and the
    nodes newly quarantined."""
    # The trainer resumes from the newest checkpoint in storage, which may be newer than the last
    # one the operator saw; the ResumedFrom Event and restartHistory then give the actual step.
    resume = (
        f"the newest checkpoint (step {latest_checkpoint_step} or newer)"
        if latest_checkpoint_step is not None
        else "the newest checkpoint (none seen yet: the start if none is written)"
    )
    how = {"in-place": " in place", "spare": " on a hot spare"}.get(mode, "")
    many = len(new_quarantine) > 1
    return (
        f"{failure.message}; restarting{how} as attempt {attempt + 1} from {resume} in {delay:g} s "
        f"({left} of {budget} restarts left without progress)"
        + (
            f"; quarantined node{'s' if many else ''} {', '.join(new_quarantine)}"
            if new_quarantine
            else ""
        )
    )


def _steps_recomputed(
    failure: Failure, reached_step: int | None, latest_checkpoint_step: int | None
) -> int | None:
    """Steps the next attempt trains again: from the checkpoint it resumes from to the step the
    failed attempt reached. A graceful stop may write a newer checkpoint than the operator knows
    of: unknown until the trainer reports the step it resumed from (RestartRecord.resumed)."""
    if reached_step is None or failure.reason in GRACEFUL_REASONS:
        return None
    return max(reached_step - (latest_checkpoint_step or 0), 0)
