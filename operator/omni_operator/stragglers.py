"""Straggler detection: a pure function from the trainer's per-node busy times to the nodes
that are persistently slower than the others.

The trainer serves, per node, the median busy seconds per step of its slowest rank over its
last steps (``omni_trainer_node_busy_seconds``; busy = the step minus the waits for peers, so a
slow node stands out although every rank's wall step time is the same). A node is *slow* at a
poll when its figure exceeds the median of the OTHER nodes' figures by more than the margin
(leave-one-out: with two nodes it is compared with the other one, and the slow node never
drags the reference up). It is a *straggler* once it has been slow at every poll for
``persistSteps`` training steps; one slow poll or step is not. A straggler stays one until it
is within half the margin (hysteresis: a node near the margin does not flap).

The state between polls lives in the job's ``status.stragglers``, so an operator restart
forgets nothing. With ``action: replace`` a straggler becomes a failure of the attempt once the
trainer reports a checkpoint newer than the detection: the node is quarantined and the job
restarts without it (its pods deleted with their grace, so the trainers also write an
emergency checkpoint of the step they reached).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from omni_operator.recovery.failures import Failure
from omni_operator.spec import StragglersConfig
from omni_operator.status import StragglerStatus


def slow_nodes(busy: Mapping[int, float], *, margin: float) -> dict[int, float]:
    """The node ranks slower than the other nodes' median by more than ``margin``, each with
    that median (fewer than two nodes: none)."""
    out: dict[int, float] = {}
    for rank, seconds in busy.items():
        others = [v for r, v in busy.items() if r != rank]
        if not others:
            continue
        reference = statistics.median(others)
        if reference > 0 and seconds > reference * (1 + margin):
            out[rank] = reference
    return out


def track(
    previous: Sequence[StragglerStatus],
    busy: Mapping[int, float],
    *,
    step: int,
    placement: Sequence[str],
    cfg: StragglersConfig,
) -> list[StragglerStatus]:
    """The slow nodes after one poll.

    Args:
        previous: ``status.stragglers`` before this poll.
        busy: busy seconds per node rank, as the trainer serves them.
        step: the trainer's step at this poll.
        placement: node names by node rank (a rank outside it, or a node that is no longer
            at its rank, has left: it is forgotten).
        cfg: ``restartPolicy.stragglers``.

    Returns:
        One entry per node slow at this poll, by node rank; ``detectedStep`` is set once it has
        been slow for ``persistSteps`` steps (and kept while it stays slow).
    """
    before = {(p.node_rank, p.node): p for p in previous}
    slow = slow_nodes(busy, margin=cfg.margin)
    # hysteresis: a straggler stays one until it is within half the margin (no flapping Events)
    for rank, reference in slow_nodes(busy, margin=cfg.margin / 2).items():
        prev = before.get((rank, placement[rank])) if rank < len(placement) else None
        if prev is not None and prev.detected_step is not None:
            slow.setdefault(rank, reference)
    out = []
    for rank, reference in sorted(slow.items()):
        if rank >= len(placement):
            continue
        node = placement[rank]
        prev = before.get((rank, node))
        since = prev.slow_since_step if prev is not None else step
        detected = prev.detected_step if prev is not None else None
        if detected is None and step - since >= cfg.persist_steps:
            detected = step
        out.append(
            StragglerStatus(
                node=node,
                node_rank=rank,
                busy_seconds=round(busy[rank], 6),
                median_seconds=round(reference, 6),
                slow_since_step=since,
                detected_step=detected,
            )
        )
    return out


def describe(s: StragglerStatus) -> str:
    """One line naming the node and its figures (condition message, Event)."""
    return (
        f"node {s.node} (rank {s.node_rank}) busy {s.busy_seconds:.3f} s per step, "
        f"{s.ratio:.2f}x the other nodes' median {s.median_seconds:.3f} s, "
        f"slow since step {s.slow_since_step}"
    )


def replacement(
    found: Sequence[StragglerStatus], *, checkpoint_step: int | None, cfg: StragglersConfig
) -> Failure | None:
    """The failure that replaces a straggler (``action: replace``), once a checkpoint newer
    than its detection is complete; None while there is none or nothing to replace."""
    if cfg.action != "replace" or checkpoint_step is None:
        return None
    due = [s for s in found if s.detected_step is not None and checkpoint_step > s.detected_step]
    if not due:
        return None
    return Failure(
        "straggler",
        "; ".join(map(describe, due))
        + f": replaced after checkpoint step {checkpoint_step} (restartPolicy.stragglers.action)",
        nodes=tuple(s.node for s in due),
    )
