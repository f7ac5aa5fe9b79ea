"""Per-node busy time, the figure the operator finds stragglers by.

In a synchronous job every rank's wall step time is the same: a slow node makes the others
wait for it in collectives. What differs is the *busy* time: the step minus the time a rank
waited on its peers (``peer_wait``: a step's arrival barriers, at its start, before the gradient
reduction and after the optimizer; ``pipeline_wait`` and ``encoder_wait``: point-to-point
waits). A slow node waits least, so its busy time is the longest. With one barrier only (before
the gradient reduction) the ranks sat out a slow rank's optimizer and loop work inside the
parameters' all-gather and the data plane's exchange, counted as their own busy time, and
every rank reported the slow one's figure (``tests/dist/test_busy_time.py``).

Each rank keeps a window of its busy times; every ``every`` steps one small object all-gather
(gloo) brings every rank's window median to global rank 0, which keeps the slowest rank of
each node (a node is as slow as its slowest GPU) and serves them as
``omni_trainer_node_busy_seconds{node_rank}``.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Mapping

import torch.distributed as dist

from omni_trainer.distributed import comm

WAIT_PHASES = ("peer_wait", "pipeline_wait", "encoder_wait")
"""Step phases that are time spent waiting on other ranks, not working."""
GATHER_EVERY = 5
"""Steps between two gathers: one small object all-gather per this many steps."""
WINDOW = 20
"""Steps in a rank's busy-time window (the median of a window, not one step, is reported)."""
WARMUP = 5
"""First steps of an attempt left out: their one-time costs (allocator growth, lazy
communicators, the resumed checkpoint's reads) differ per node and are no slowness."""


def busy_seconds(step_seconds: float, phases: Mapping[str, float]) -> float:
    """The step's wall time minus the time this rank waited on its peers."""
    return max(step_seconds - sum(phases.get(p, 0.0) for p in WAIT_PHASES), 0.0)


def node_rank_from_env(rank: int, environ: Mapping[str, str] | None = None) -> int:
    """This process's node: torchrun's ``GROUP_RANK``, else rank // ``LOCAL_WORLD_SIZE``."""
    env = os.environ if environ is None else environ
    if "GROUP_RANK" in env:
        return int(env["GROUP_RANK"])
    return rank // max(int(env.get("LOCAL_WORLD_SIZE", "1")), 1)


def node_medians(reports: list[tuple[int, float]]) -> dict[int, float]:
    """Per node, the slowest rank's window median (reports: (node rank, median) per rank)."""
    out: dict[int, float] = {}
    for node, median in reports:
        out[node] = max(out.get(node, 0.0), median)
    return dict(sorted(out.items()))


class BusyTracker:
    """A rank's busy-time window; every ``every`` steps the per-node medians on rank 0.

    Args:
        node_rank: this process's node.
        group: the group the gather runs over (every rank of the job; None: the default group).
        every: steps between gathers (each one is a collective: every rank calls :meth:`observe`
            for every step).
        window: steps in the window; nothing is gathered before it is full, so a median
            always covers ``window`` steps of this attempt (a restart's first poll had
            reported one step and quarantined healthy nodes).
        warmup: the attempt's first steps, left out of the window.
    """

    def __init__(
        self,
        *,
        node_rank: int,
        group: dist.ProcessGroup | None = None,
        every: int = GATHER_EVERY,
        window: int = WINDOW,
        warmup: int = WARMUP,
    ) -> None:
        if every < 1 or window < 1 or warmup < 0:
            raise ValueError(
                f"every and window must be >= 1 and warmup >= 0, got {every}, {window}, {warmup}"
            )
        self.node_rank, self.group, self.every = node_rank, group, every
        self.warmup_left = warmup
        self.busy: deque[float] = deque(maxlen=window)

    def observe(self, step: int, busy: float) -> dict[int, float] | None:
        """Record step ``step``'s (1-based) busy time; on gather steps, every node's median
        (on every rank; only rank 0 exports it), else None. Every rank observes the same
        steps, so every rank's window fills at the same step and the gathers pair up."""
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return None
        self.busy.append(busy)
        if step % self.every or len(self.busy) < (self.busy.maxlen or 0):
            return None
        mine = (self.node_rank, statistics.median(self.busy))
        return node_medians(comm.all_gather_object(mine, group=self.group))
