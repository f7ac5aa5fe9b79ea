"""Trainer progress for the operator, read from the trainer's Prometheus endpoint.

The rank-0 pod serves ``omni_trainer_step``, tokens/s, MFU and the latest complete checkpoint
step on its ``metrics`` port. The operator polls it on every resync: the step feeds hang
detection, the checkpoint step refills the restart budget, tokens/s and MFU go into the status,
the per-node busy times feed straggler detection.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from omni_operator.reconcile import Progress
from omni_operator.render import LABEL_RANK, METRICS_PORT
from omni_trainer.pod_protocol import (
    ATTEMPT_METRIC,
    CHECKPOINT_STEP_METRIC,
    METRIC_PREFIX,
    MFU_METRIC,
    NODE_BUSY_METRIC,
    RESUMED_FROM_METRIC,
    STEP_METRIC,
    TOKENS_PER_SECOND_METRIC,
)

_FIELDS = {
    METRIC_PREFIX + STEP_METRIC: "step",
    METRIC_PREFIX + CHECKPOINT_STEP_METRIC: "checkpoint_step",
    METRIC_PREFIX + TOKENS_PER_SECOND_METRIC: "tokens_per_second",
    METRIC_PREFIX + MFU_METRIC: "mfu",
    METRIC_PREFIX + RESUMED_FROM_METRIC: "resumed_from",
    METRIC_PREFIX + ATTEMPT_METRIC: "attempt",
}
"""The trainer's metrics (:mod:`omni_trainer.pod_protocol`) -> :class:`Progress` fields."""

NODE_BUSY = METRIC_PREFIX + NODE_BUSY_METRIC
"""Per node rank: busy seconds per step (straggler detection, ``omni_operator.stragglers``)."""


def parse_progress(text: str) -> Progress:
    """The progress figures in a scrape (missing ones stay None)."""
    values: dict[str, Any] = {}
    busy: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _FIELDS.get(sample.name)
            if field is not None:
                values[field] = sample.value
            elif sample.name == NODE_BUSY and sample.labels.get("node_rank", "").isdigit():
                busy[int(sample.labels["node_rank"])] = sample.value
    if busy:
        values["node_busy"] = dict(sorted(busy.items()))
    for key in ("step", "checkpoint_step", "resumed_from", "attempt"):
        if key in values:
            values[key] = int(values[key])
    return Progress(**values)


class MetricsProgress:
    """The default progress source: scrape node rank 0's trainer (it hosts global rank 0)."""

    def __init__(self, *, port: int = METRICS_PORT, timeout_s: float = 2.0) -> None:
        self.port = port
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __call__(self, job: Any, pods: list[dict[str, Any]]) -> Progress | None:
        ip = _rank0_ip(pods)
        if ip is None:
            return None
        try:
            async with aiohttp.ClientSession(timeout=self.timeout) as session:
                url = f"http://{ip}:{self.port}/metrics"
                async with session.get(url) as resp:
                    if resp.status != 200:
                        return None
                    return parse_progress(await resp.text())
        except (TimeoutError, aiohttp.ClientError):
            return None  # not up yet, or restarting: no news is not progress


def _rank0_ip(pods: list[dict[str, Any]]) -> str | None:
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels", {})
        status = pod.get("status", {})
        if labels.get(LABEL_RANK) == "0" and status.get("phase") == "Running":
            return status.get("podIP")
    return None
