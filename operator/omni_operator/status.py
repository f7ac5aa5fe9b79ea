"""``status`` of an OmniTrainingJob: written by the operator, read by ``kubectl get`` and users.

Modelled like the spec so that the CRD's status schema is generated, not hand-written.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from omni_trainer.config_base import Spec

Phase = Literal[
    "Pending",
    "Placing",
    "Queued",
    "Starting",
    "Running",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
]
"""``Starting``: the attempt's pods exist but not all trainers run yet (scheduling, image
pulls); ``Running``: every trainer container runs."""


class Condition(Spec):
    """A Kubernetes-style condition (``type`` is e.g. Valid, Placed, Running, Complete)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase machine-readable cause")
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RestartRecord(Spec):
    """One whole-job restart and why it happened."""

    attempt: int = Field(ge=1)
    reason: str = Field(description="NodeLost, PodFailed, PodEvicted, PodDeleted, Hang, ...")
    message: str = ""
    time: str | None = None
    nodes: list[str] = Field(default_factory=list, description="nodes involved in the failure")
    from_step: int | None = Field(
        None,
        description="checkpoint step the restart resumes from: the latest the operator saw, "
        "then the one the trainer reports it resumed from (confirmed)",
    )
    confirmed: bool = Field(False, description="fromStep is what the trainer reported")
    delay_seconds: float = Field(0.0, ge=0, description="backoff before the new pods were created")
    mode: Literal["in-place", "recreate", "spare"] = Field(
        "recreate",
        description="how the job restarted: in-place (the pods and their containers kept, the "
        "trainers restarted inside them), recreate (the pods deleted and created again), spare",
    )
    lost_seconds: float | None = Field(
        None, ge=0, description="from the failure's detection to the first step after the restart"
    )
    steps_recomputed: int | None = Field(
        None, ge=0, description="steps trained before the failure beyond fromStep (done again)"
    )
    reached_step: int | None = Field(
        None,
        ge=0,
        description="the last step the failed attempt was seen to complete; stepsRecomputed "
        "counts from it to the step the trainer resumed from",
    )

    def resumed(self, resumed_from: int | None) -> RestartRecord:
        """The record once the trainer reports the step it resumed from (None or 0: the
        start): ``fromStep`` that step, ``stepsRecomputed`` from ``reachedStep`` (also after a
        graceful stop, whose emergency checkpoint the operator could not know of, and after a
        fallback past a corrupt or partial checkpoint)."""
        actual = resumed_from or None
        reached = self.reached_step
        if reached is None and self.steps_recomputed is not None:  # recorded before reachedStep
            reached = self.steps_recomputed + (self.from_step or 0)
        update: dict[str, Any] = {"from_step": actual, "confirmed": True}
        if reached is not None:
            update["steps_recomputed"] = max(reached - (actual or 0), 0)
        return self.model_copy(update=update)


class QuarantineEntry(Spec):
    """One quarantined node in ``status.quarantine``."""

    node: str
    reason: str = Field(description="the last failure that blamed it: NodeLost, DeviceError, ...")
    message: str = ""
    since: str = Field(description="when it was quarantined (RFC 3339)")
    until: str = Field(
        description="the earliest lift (RFC 3339); then it is lifted once the node has been "
        "Ready for restartPolicy.quarantineReadySeconds"
    )


class StragglerStatus(Spec):
    """A node whose busy time per step exceeds the other nodes' median by the margin."""

    node: str
    node_rank: int = Field(ge=0)
    busy_seconds: float = Field(ge=0, description="its busy seconds per step (window median)")
    median_seconds: float = Field(ge=0, description="the other nodes' median busy seconds")
    slow_since_step: int = Field(ge=0, description="the step at which it was first seen slow")
    detected_step: int | None = Field(
        None,
        description="the step at which it had been slow restartPolicy.stragglers."
        "persistSteps long (None: not yet a straggler)",
    )

    @property
    def ratio(self) -> float:
        """How many times slower than the median it is."""
        return self.busy_seconds / self.median_seconds if self.median_seconds else 0.0


class CheckpointStatus(Spec):
    """The latest complete checkpoint the trainer reported."""

    step: int = Field(ge=0)
    path: str | None = None
    time: str | None = None


class NodeLink(Spec):
    """A node's figure in the network preflight."""

    node: str
    gbps: float | None = Field(None, description="its best link in GB/s (null: no answer)")


class PreflightStatus(Spec):
    """The latest network preflight of the gang (``spec.preflight``): per node figures."""

    verdict: Literal["Passed", "Failed"]
    time: str = Field(description="when the operator saw the result")
    nodes: list[NodeLink] = Field(
        default_factory=list,
        description="each node's best link (a list: a merge patch replaces it whole)",
    )
    failed: list[str] = Field(default_factory=list)
    all_reduce_gbps: float | None = Field(None, description="all-reduce bus bandwidth, GB/s")
    all_gather_gbps: float | None = Field(None, description="all-gather bus bandwidth, GB/s")
    floor_gbps: float | None = None
    median_gbps: float | None = None
    seconds: float | None = Field(None, description="what the check added to the attempt")

    @classmethod
    def from_report(cls, doc: dict[str, Any], time: str) -> PreflightStatus:
        """From the trainer's result (``PreflightResult`` as a dict)."""
        known = {k: v for k, v in doc.items() if k in cls.model_fields}
        known["nodes"] = [{"node": n, "gbps": g} for n, g in (doc.get("nodes") or {}).items()]
        verdict = "Passed" if doc.get("passed", not doc.get("failed")) else "Failed"
        return cls.model_validate({**known, "verdict": verdict, "time": time})


class SpareStatus(Spec):
    """One hot spare's standby pod (spec.spareNodes)."""

    pod: str
    node: str | None = Field(None, description="the node it is placed on")
    ready: bool = Field(False, description="its container runs: it can take a rank over")


class OmniTrainingJobStatus(Spec):
    """What the operator last observed and decided."""

    phase: Phase | None = None
    message: str | None = None
    observed_generation: int | None = None
    attempt: int = Field(0, ge=0, description="restart attempt of the trainers (0: first)")
    pod_attempt: int | None = Field(
        None,
        ge=0,
        description="the attempt whose pods run the trainers (their names and labels) when an "
        "in-place restart kept them; None: the pods are attempt's own",
    )
    restarts: int = Field(0, ge=0)
    restart_budget_left: int | None = None
    step: int | None = None
    last_progress_time: str | None = Field(
        None, description="when the step last advanced (or the attempt started); hang detection"
    )
    attempt_start_time: str | None = Field(
        None, description="when the current attempt's pods were created (start timeout)"
    )
    first_step_time: str | None = Field(
        None, description="when the current attempt's trainer first reported a step"
    )
    tokens_per_second: float | None = Field(
        None, description="the trainer's latest (after Succeeded: final) tokens/s, whole tokens"
    )
    mfu: float | None = Field(None, description="model FLOPs utilization, a fraction")
    mfu_percent: str | None = Field(None, description="mfu as the logs print it, e.g. 41.27%")
    last_checkpoint: CheckpointStatus | None = None
    placement: list[str] = Field(default_factory=list, description="node names by node rank")
    quarantined_nodes: list[str] = Field(
        default_factory=list, description="the nodes of quarantine, by name (placement avoids)"
    )
    quarantine: list[QuarantineEntry] = Field(
        default_factory=list, description="quarantined nodes: why, since and until when"
    )
    placing_since: str | None = Field(
        None,
        description="since when the attempt waits for nodes (restartPolicy."
        "placementTimeoutSeconds then fails the job)",
    )
    preflight: PreflightStatus | None = None
    stragglers: list[StragglerStatus] = Field(
        default_factory=list, description="nodes slower than the others (see condition Straggler)"
    )
    spares: list[SpareStatus] = Field(
        default_factory=list, description="standby pods of spec.spareNodes, by name"
    )
    conditions: list[Condition] = Field(default_factory=list)
    restart_history: list[RestartRecord] = Field(default_factory=list)
    start_time: str | None = None
    completion_time: str | None = None
    # kopf keeps handler progress here; its shape is kopf's, so it is not modelled.
    kopf: dict[str, Any] | None = None

    @property
    def pods_of(self) -> int:
        """The attempt in the names and labels of the pods the trainers run in."""
        return self.attempt if self.pod_attempt is None else self.pod_attempt
