"""Quarantine with a lifecycle: which nodes a job avoids, why, and until when (pure).

Only failures a node can be blamed for count (:func:`failure_origin.blames_nodes`: node lost or
NotReady, device and fabric errors, a straggler, a failed network preflight); a crash of the
trainer's own code, a lost container or an eviction never do. A node reaching
``restartPolicy.quarantineAfterFailures`` such failures within ``quarantineSeconds`` (a
straggler or a preflight's named node: at once) is quarantined until ``quarantineSeconds``
from then; once that passed, it is lifted as soon as the node has been Ready for
``quarantineReadySeconds`` (a node still down stays quarantined, and placement could not use it
anyway). Failures older than the window no longer count, so a lifted node starts clean.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omni_operator.failure_origin import blames_nodes
from omni_operator.spec import RestartPolicyConfig
from omni_operator.status import QuarantineEntry, RestartRecord
from omni_operator.times import format_time, parse_time

AT_ONCE_REASONS = frozenset({"Straggler", "PreflightFailed"})
"""Failures that quarantine their nodes at the first occurrence (being replaced)."""


def blame_counts(
    history: Sequence[RestartRecord],
    *,
    now: dt.datetime,
    window_seconds: float,
    extra: tuple[str, Sequence[str]] | None = None,
) -> Counter[str]:
    """Failures blaming each node within ``window_seconds`` before ``now`` (records without a
    time count), plus ``extra`` (reason, nodes) for the failure being decided."""
    counts: Counter[str] = Counter()
    for r in history:
        when = parse_time(r.time)
        recent = when is None or (now - when).total_seconds() <= window_seconds
        if recent and blames_nodes(r.reason):
            counts.update(r.nodes)
    if extra is not None and blames_nodes(extra[0]):
        counts.update(extra[1])
    return counts


def to_quarantine(
    history: Sequence[RestartRecord],
    reason: str,
    nodes: Sequence[str],
    *,
    policy: RestartPolicyConfig,
    now: dt.datetime,
) -> tuple[str, ...]:
    """The nodes the failure (``reason`` on ``nodes``) puts in quarantine, with the history."""
    counts = blame_counts(
        history, now=now, window_seconds=policy.quarantine_seconds, extra=(reason, nodes)
    )
    at_once = set(nodes) if reason in AT_ONCE_REASONS else set()
    blamed = {n for n, c in counts.items() if c >= policy.quarantine_after_failures}
    return tuple(sorted(blamed | at_once))


def add(
    entries: Sequence[QuarantineEntry],
    nodes: Iterable[str],
    *,
    reason: str,
    message: str,
    policy: RestartPolicyConfig,
    now: dt.datetime,
) -> list[QuarantineEntry]:
    """``entries`` with ``nodes`` quarantined from ``now`` (an entry already there is renewed)."""
    until = format_time(now + dt.timedelta(seconds=policy.quarantine_seconds))
    fresh = {
        n: QuarantineEntry(
            node=n, reason=reason, message=message, since=format_time(now), until=until
        )
        for n in nodes
    }
    return sorted([*(e for e in entries if e.node not in fresh), *fresh.values()],
                  key=lambda e: e.node)  # fmt: skip


def ready_since(node: Mapping[str, Any] | None) -> dt.datetime | None:
    """When the node became Ready (None: it is not Ready, or gone)."""
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return None
    return parse_time(ready.get("lastTransitionTime")) or dt.datetime.min.replace(tzinfo=dt.UTC)


def lift(
    entries: Sequence[QuarantineEntry],
    nodes: Mapping[str, Mapping[str, Any]],
    *,
    policy: RestartPolicyConfig,
    now: dt.datetime,
) -> tuple[list[QuarantineEntry], list[QuarantineEntry]]:
    """(kept, lifted): an entry is lifted once its ``until`` passed and its node has been Ready
    for ``quarantineReadySeconds``."""
    kept, lifted = [], []
    for e in entries:
        until = parse_time(e.until)
        since = ready_since(nodes.get(e.node))
        due = until is not None and now >= until
        healthy = (
            since is not None and (now - since).total_seconds() >= policy.quarantine_ready_seconds
        )
        (lifted if due and healthy else kept).append(e)
    return kept, lifted


def next_lift(entries: Sequence[QuarantineEntry], now: dt.datetime) -> float | None:
    """Seconds until the earliest ``until`` (None: no entry), to look again then."""
    times = [t for e in entries if (t := parse_time(e.until)) is not None]
    return max(min((t - now).total_seconds() for t in times), 1.0) if times else None


def describe(entries: Sequence[QuarantineEntry]) -> str:
    """In words, for messages: ``n1 (NodeLost, until 2026-...)``."""
    return ", ".join(f"{e.node} ({e.reason}, until {e.until})" for e in entries)
