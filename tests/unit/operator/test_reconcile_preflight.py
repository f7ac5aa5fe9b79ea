"""The network preflight in the job's status: a failed one quarantines the named node, records
the figures and restarts without spending budget; a passed one's figures land on success."""

from __future__ import annotations

import json
from dataclasses import asdict

from omni_operator.reconcile import reconcile
from omni_trainer.distributed.netcheck_rules import (
    EXIT_PREFLIGHT,
    PreflightResult,
    failure_message,
)

from .test_reconcile import T, _cond, _job, _obs, _start, _succeeded


def test_a_silent_node_is_quarantined_and_recorded_and_the_gang_restarts() -> None:
    job = _job()
    status, owned = _start(job)
    pods = [o for o in owned if o["kind"] == "Pod"]
    silent = pods[1]["spec"]["nodeName"]
    alone = PreflightResult(nodes={silent: None}, failed=[silent], complete=False)
    term = {"terminated": {"exitCode": EXIT_PREFLIGHT, "finishedAt": T,
                           "message": failure_message(alone)}}  # fmt: skip
    owned = [
        {**o, "status": {"phase": "Failed", "containerStatuses": [{"state": term}]}}
        if o is pods[0]
        else o
        for o in owned
    ]
    a = reconcile(_obs(job, status, owned))
    assert a.status["phase"] == "Restarting"
    assert a.status["quarantinedNodes"] == [silent]
    assert {**status, **a.status}["restartBudgetLeft"] == 10  # named its node: not charged
    assert a.status["preflight"]["verdict"] == "Failed"
    assert a.status["preflight"]["failed"] == [silent]
    assert _cond(a.status, "Preflight")["reason"] == "PreflightFailed"
    event = next(e for e in a.events if e.reason == "PreflightFailed")
    assert silent in event.message and "quarantined node" in event.message


def test_success_records_the_passing_figures() -> None:
    job = _job()
    status, owned = _start(job)
    passed = PreflightResult(nodes={"n0": 3.5, "n1": 3.1}, all_reduce_gbps=2.0, seconds=1.5)
    final = json.dumps({"step": 10, "preflight": asdict(passed)})
    a = reconcile(_obs(job, status, _succeeded(owned, final), progress=None))
    assert a.status["phase"] == "Succeeded"
    pf = a.status["preflight"]
    assert pf["verdict"] == "Passed" and pf["nodes"] == [
        {"node": "n0", "gbps": 3.5},
        {"node": "n1", "gbps": 3.1},
    ]
    assert pf["allReduceGbps"] == 2.0 and pf["seconds"] == 1.5 and pf["time"] == T
    assert _cond(a.status, "Preflight")["status"] == "True"
