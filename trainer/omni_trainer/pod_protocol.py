"""The operator<->pod protocol: the order file naming the attempt each pod runs, the environment
a started attempt gets, the tag on a failure's message, torchrun's rendezvous id per attempt.

The operator writes orders and reads tags; the pod's supervisor reads orders and writes tags. The
trainer serves its progress as Prometheus metrics under the names below; the operator reads them.
Standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ATTEMPT_KEY = "attempt"
"""The file (in the pod's order volume; a key of the job's ConfigMap for pods of older operator
versions) naming the attempt to run, as
:func:`order`: ``{"attempt": N, "pods": M}``, for the pods created by attempt M only (pods of an
older attempt, still running on a partitioned node, must not start it)."""
STATE_DIR = "/var/run/omni"
"""An emptyDir: what the supervisor started survives a restart of its container."""
ATTEMPT_ENV = "OMNI_RESTART_ATTEMPT"
SAME_NODES_ENV = "OMNI_SAME_NODES"
"""Set to ``1`` for a trainer started in pods an earlier attempt created (an in-place restart):
its nodes already passed the network preflight, which runs on new nodes only. Every pod of the
gang gets the same order, so all ranks agree."""
SPARES_KEY = "spares"
"""In an order: ``{pod name: {env name: value}}``, the spare pods that took a node rank over and
that rank's environment (``OMNI_NODE_RANK``...)."""
FRESH_KEY = "fresh"
"""In an order: a spare joined the gang at this attempt, so its nodes are not all known-good."""
RANK_ENV = "OMNI_NODE_RANK"

METRIC_PREFIX = "omni_trainer_"
"""Every metric the trainer serves is named ``METRIC_PREFIX + name``."""
STEP_METRIC = "step"
CHECKPOINT_STEP_METRIC = "checkpoint_step"
TOKENS_PER_SECOND_METRIC = "tokens_per_second"
MFU_METRIC = "mfu_ratio"
RESUMED_FROM_METRIC = "resumed_from_step"
ATTEMPT_METRIC = "restart_attempt"
NODE_BUSY_METRIC = "node_busy_seconds"
"""Per node rank (label ``node_rank``): busy seconds per step, for straggler detection."""
_TAG = re.compile(r"^\[attempt (\d+)\] ?")


def tag(attempt: int, message: str) -> str:
    """A failure's termination message, tagged with the attempt that failed."""
    return f"[attempt {attempt}] {message}".rstrip()


def untag(message: str) -> tuple[int | None, str]:
    """The attempt a termination message is tagged with (None: untagged) and the message."""
    m = _TAG.match(message or "")
    return (int(m.group(1)), message[m.end() :]) if m else (None, message)


def order(
    attempt: int,
    *,
    pods: int,
    spares: Mapping[str, Mapping[str, str]] | None = None,
    fresh: bool = False,
) -> str:
    """An order: run ``attempt`` in the pods that attempt ``pods`` created, plus the
    spare pods that took ranks over (``spares``: pod -> that rank's environment); ``fresh``: a
    spare joined at this attempt."""
    doc: dict[str, object] = {"attempt": attempt, "pods": pods}
    if spares:
        doc[SPARES_KEY] = {k: dict(v) for k, v in sorted(spares.items())}
    if fresh:
        doc[FRESH_KEY] = True
    return json.dumps(doc)


@dataclass(frozen=True)
class Target:
    """What the operator's order asks of one pod."""

    attempt: int
    env: Mapping[str, str]
    """A spare's rank environment (empty for the gang's own pods)."""
    fresh: bool = False


def read_target(path: Path, *, pods: int, pod: str | None = None,
                standby: bool = False) -> Target | None:  # fmt: skip
    """The attempt the operator wants these pods (created by attempt ``pods``) to run; None
    when the file is missing, partial, addressed to other pods, or (``standby``) does not name
    this spare ``pod`` yet."""
    try:
        data = json.loads(path.read_text())
        if int(data["pods"]) != pods:
            return None
        env = (data.get(SPARES_KEY) or {}).get(pod) if pod else None
        if standby and env is None:
            return None
        return Target(int(data["attempt"]), {str(k): str(v) for k, v in (env or {}).items()},
                      fresh=bool(data.get(FRESH_KEY)))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def rdzv_id(attempt: int) -> str:
    """torchrun's ``--rdzv-id`` for ``attempt``: the prefix of its rendezvous keys."""
    return f"attempt-{attempt}"
