"""Quarantine with a lifecycle: entries say why and until when, lift on Ready nodes, and a job
that cannot be placed waits with a condition and fails with the reason after a deadline."""

from __future__ import annotations

import datetime as dt

from omni_operator import quarantine
from omni_operator.reconcile import reconcile
from omni_operator.status import Condition, OmniTrainingJobStatus, QuarantineEntry, RestartRecord
from omni_operator.times import format_time

from .nodes import node
from .test_reconcile import NOW, T, _cond, _job, _obs, _start


def _at(seconds: float) -> str:
    return format_time(NOW + dt.timedelta(seconds=seconds))


def _ready(name: str, since_s: float, *, at: float = 0) -> dict:
    """Node ``name``, Ready for ``since_s`` seconds at ``at`` seconds from NOW."""
    n = node(name)
    n["status"]["conditions"] = [
        {"type": "Ready", "status": "True", "lastTransitionTime": _at(at - since_s)}
    ]
    return n


POLICY = _job().spec.restart_policy  # quarantineSeconds 3600, quarantineReadySeconds 300


def test_entries_say_why_and_until_when_and_lift_on_ready_nodes() -> None:
    entries = quarantine.add([], ["n1", "n0"], reason="NodeLost", message="gone", policy=POLICY,
                             now=NOW)  # fmt: skip
    assert [(e.node, e.since, e.until) for e in entries] == [
        ("n0", T, _at(3600)),
        ("n1", T, _at(3600)),
    ]
    later = NOW + dt.timedelta(seconds=3600)
    nodes = {"n0": _ready("n0", 300, at=3600), "n1": _ready("n1", 299, at=3600)}
    kept, lifted = quarantine.lift(entries, nodes, policy=POLICY, now=later)
    assert [e.node for e in lifted] == ["n0"] and [e.node for e in kept] == ["n1"]
    assert (
        quarantine.lift(entries, nodes, policy=POLICY, now=later - dt.timedelta(seconds=1))[1] == []
    )  # not yet due
    assert quarantine.lift(entries, {}, policy=POLICY, now=later)[1] == []  # the node is gone
    assert quarantine.next_lift(entries, NOW) == 3600
    assert "n0 (NodeLost, until " in quarantine.describe(entries)


def _quarantined(*names: str, until: str) -> dict:
    entries = [QuarantineEntry(node=n, reason="NodeLost", since=T, until=until) for n in names]
    return OmniTrainingJobStatus(
        phase="Restarting",
        attempt=1,
        quarantined_nodes=list(names),
        quarantine=entries,
        restart_history=[RestartRecord(attempt=1, reason="NodeLost", time=T, nodes=list(names))],
        conditions=[Condition(type="Valid", status="True", reason="SpecValid")],
    ).model_dump(mode="json", by_alias=True)


def test_a_job_that_cannot_be_placed_waits_then_fails_with_the_reason() -> None:
    nodes = [_ready(f"n{i}", 10_000) for i in range(2)]
    status = _quarantined("n0", until=_at(7200))  # 1 usable node of 2 needed
    a = reconcile(_obs(_job(), status, nodes=nodes))
    assert a.status["phase"] == "Placing" and a.status["placingSince"] == T
    placed = _cond(a.status, "Placed")
    assert placed["status"] == "False" and "quarantined: n0 (NodeLost, until " in placed["message"]
    assert "waiting up to 1800 s more" in placed["message"] and a.requeue_after == 1800
    later = NOW + dt.timedelta(seconds=1800)
    b = reconcile(_obs(_job(), {**status, **a.status}, nodes=nodes, now=later))
    assert b.status["phase"] == "Failed" and _cond(b.status, "Failed")["reason"] == "Unplaceable"
    assert "placementTimeoutSeconds 1800" in b.status["message"] and "n0" in b.status["message"]


def test_an_expired_quarantine_lifts_and_the_job_is_placed_again() -> None:
    nodes = [_ready(f"n{i}", 10_000) for i in range(2)]
    status = _quarantined("n0", "n1", until=T)
    a = reconcile(_obs(_job(), status, nodes=nodes))
    assert a.status["quarantinedNodes"] == [] and a.status["quarantine"] == []
    assert a.status["phase"] == "Starting" and sorted(a.status["placement"]) == ["n0", "n1"]
    assert [e.reason for e in a.events][:1] == ["QuarantineLifted"]


def test_a_node_lost_twice_is_quarantined_with_an_entry() -> None:
    job = _job(restartPolicy={"nodeLostGraceSeconds": 5})
    status, owned = _start(job)
    history = [RestartRecord(attempt=1, reason="NodeLost", time=T, nodes=["n1"]).model_dump(
        mode="json", by_alias=True)]  # fmt: skip
    nodes = [node("n0"), node("n1", ready=False), node("n2"), node("n3")]
    a = reconcile(_obs(job, {**status, "restartHistory": history}, owned, nodes=nodes))
    (entry,) = a.status["quarantine"]
    assert entry["node"] == "n1" and entry["reason"] == "NodeLost" and entry["until"] == _at(3600)
    assert a.status["quarantinedNodes"] == ["n1"]
