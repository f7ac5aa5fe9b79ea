"""Straggler detection on hand-made sequences of per-node busy times, and what reconcile makes
of it: status.stragglers, condition Straggler, one Warning Event per detection."""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from omni_operator.reconcile import Actions, Observed, Progress, parse_status, reconcile
from omni_operator.spec import StragglersConfig, parse_job
from omni_operator.status import StragglerStatus
from omni_operator.stragglers import describe, slow_nodes, track
from omni_trainer.config import ManifestError

from ...conftest import EXAMPLES
from .nodes import node

CFG = StragglersConfig(margin=0.2, persist_steps=20)
PLACEMENT = ["n0", "n1", "n2", "n3"]


def _run(polls: list[tuple[int, dict[int, float]]], placement=PLACEMENT) -> list[StragglerStatus]:
    state: list[StragglerStatus] = []
    for step, busy in polls:
        state = track(state, busy, step=step, placement=placement, cfg=CFG)
    return state


def test_slow_means_over_the_margin_above_the_other_nodes_median() -> None:
    assert slow_nodes({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.3}, margin=0.2) == {3: 1.0}
    assert slow_nodes({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.15}, margin=0.2) == {}
    assert slow_nodes({0: 1.0}, margin=0.2) == {}  # nothing to compare with
    # two nodes: each is compared with the other one (a plain median would sit between them)
    assert slow_nodes({0: 1.0, 1: 1.3}, margin=0.2) == {1: 1.0}
    assert slow_nodes({0: 0.0, 1: 0.5}, margin=0.2) == {}  # no reference yet


def test_persistent_slowness_is_detected_after_persist_steps() -> None:
    busy = {0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0}
    early = _run([(10, busy), (20, busy)])
    assert [(s.node, s.slow_since_step, s.detected_step) for s in early] == [("n2", 10, None)]
    (s,) = _run([(10, busy), (20, busy), (30, busy), (45, busy)])
    assert (s.node, s.node_rank, s.slow_since_step, s.detected_step) == ("n2", 2, 10, 30)
    assert s.busy_seconds == 2.0 and s.median_seconds == 1.0 and s.ratio == 2.0
    assert "node n2 (rank 2) busy 2.000 s per step, 2.00x" in describe(s)


def test_one_off_slowness_is_forgotten() -> None:
    slow, fine = {0: 1.0, 1: 3.0}, {0: 1.0, 1: 1.05}
    (last,) = _run([(10, slow), (15, fine), (25, slow), (35, fine), (45, slow)])
    assert last.slow_since_step == 45 and last.detected_step is None
    assert _run([(10, slow), (20, fine)]) == []


def test_a_straggler_stays_one_until_within_half_the_margin() -> None:
    slow, near, fine = {0: 1.0, 1: 1.5}, {0: 1.0, 1: 1.15}, {0: 1.0, 1: 1.05}
    (s,) = _run([(10, slow), (30, slow), (40, near)])
    assert (s.slow_since_step, s.detected_step, s.busy_seconds) == (10, 30, 1.15)
    assert _run([(10, slow), (30, slow), (40, fine)]) == []
    assert _run([(10, slow), (20, near)]) == []  # not yet detected: the full margin applies


def test_a_node_that_left_is_forgotten() -> None:
    busy = {0: 1.0, 1: 2.0}
    state = _run([(10, busy), (40, busy)], placement=["n0", "n1"])
    assert state[0].detected_step == 40
    # the job now runs on n0 and n3: rank 1 is another node, its history starts again
    again = track(state, busy, step=50, placement=["n0", "n3"], cfg=CFG)
    assert [(s.node, s.slow_since_step, s.detected_step) for s in again] == [("n3", 50, None)]
    assert track(state, busy, step=50, placement=["n0"], cfg=CFG) == []  # rank 1 is gone


def _job(**stragglers):
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="uid-1")
    doc["spec"].update(nodes=2, gpusPerNode=0)
    doc["spec"]["restartPolicy"] = {"stragglers": {"persistSteps": 20, **stragglers}}
    return parse_job(doc)


NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
NODES = [node(f"n{i}") for i in range(4)]


class Running:
    """A two-node job whose attempt 0 runs; :meth:`poll` reconciles one progress report."""

    def __init__(self, job, nodes: list | None = None) -> None:
        self.job, self.nodes = job, NODES if nodes is None else nodes
        first = reconcile(Observed(job=job, status=parse_status(None), owned=[],
                                   nodes=self.nodes, now=NOW))  # fmt: skip
        self.status = first.status
        self.owned = []
        for o in first.create:
            if o["kind"] == "Pod":
                placed = o["metadata"]["annotations"]["omni.megascale.io/placed-node"]
                o = {**o, "spec": {**o["spec"], "nodeName": placed}, "status": {"phase": "Running"}}
            self.owned.append(o)

    def poll(self, step: int, busy: dict[int, float], checkpoint: int | None = None) -> Actions:
        progress = Progress(step=step, node_busy=busy, checkpoint_step=checkpoint)
        obs = Observed(job=self.job, status=parse_status(self.status), owned=self.owned,
                       nodes=self.nodes, now=NOW, progress=progress,
                       tracks_progress=True)  # fmt: skip
        a = reconcile(obs)
        self.status = {**self.status, **a.status}
        return a


def test_reconcile_reports_a_straggler_once_with_a_condition_and_an_event() -> None:
    job = Running(_job())
    events = []
    for step in (10, 20, 30, 40):
        a = job.poll(step, {0: 0.1, 1: 0.25})
        events += [e for e in a.events if e.reason == "Straggler"]
        if step == 10:  # slow, not yet persistently: listed, and named by the condition too
            (watched,) = job.status["stragglers"]
            cond = next(c for c in job.status["conditions"] if c["type"] == "Straggler")
            assert (
                cond["status"] == "False"
                and f"watching node {watched['node']}" in (cond["message"])
            )
    status = job.status
    slow = status["placement"][1]
    (entry,) = status["stragglers"]
    assert entry["node"] == slow and entry["detectedStep"] == 30 and entry["slowSinceStep"] == 10
    cond = next(c for c in status["conditions"] if c["type"] == "Straggler")
    assert cond["status"] == "True" and cond["reason"] == "SlowNode"
    assert f"node {slow} (rank 1) busy 0.250 s per step, 2.50x" in cond["message"]
    assert [e.type for e in events] == ["Warning"] and slow in events[0].message  # once
    # it catches up: the condition clears
    a = job.poll(50, {0: 0.1, 1: 0.1})
    assert a.status["stragglers"] == []
    cond = next(c for c in a.status["conditions"] if c["type"] == "Straggler")
    assert cond["status"] == "False" and cond["reason"] == "NoStraggler"
    assert not a.delete and job.status["phase"] == "Running"  # action report: nothing restarts


def test_replace_quarantines_the_straggler_after_the_next_checkpoint_and_restarts() -> None:
    job = Running(_job(action="replace"))
    slow = job.status["placement"][1]
    for step in (10, 20, 30):
        a = job.poll(step, {0: 0.1, 1: 0.3}, checkpoint=20)
        assert not a.delete  # the checkpoint is not newer than the detection (step 30)
    assert job.status["stragglers"][0]["detectedStep"] == 30
    a = job.poll(45, {0: 0.1, 1: 0.3}, checkpoint=40)
    assert job.status["phase"] == "Restarting" and slow in job.status["quarantinedNodes"]
    (record,) = job.status["restartHistory"]
    assert record["reason"] == "Straggler" and record["nodes"] == [slow]
    assert record["mode"] == "recreate" and record["fromStep"] == 40
    assert (
        f"node {slow} (rank 1)" in record["message"] and "checkpoint step 40" in record["message"]
    )
    # every pod goes with its grace: the trainers write an emergency checkpoint of step 45
    assert len(a.delete) == 2 and all(d.grace_seconds is None for d in a.delete)
    assert job.status["stragglers"] == []
    # the next attempt is placed on other nodes
    later = NOW + dt.timedelta(seconds=600)
    owned = [o for o in job.owned if o["kind"] != "Pod"]
    b = reconcile(Observed(job=job.job, status=parse_status(job.status), owned=owned,
                           nodes=NODES, now=later, tracks_progress=True))  # fmt: skip
    assert slow not in b.status["placement"] and len(b.status["placement"]) == 2


def test_bad_settings_name_the_field() -> None:
    for bad, field in ((dict(margin=0), "margin"), (dict(action="evict"), "action"),
                       (dict(persistSteps=0), "persistSteps")):  # fmt: skip
        with pytest.raises(ManifestError, match=rf"spec.restartPolicy.stragglers.{field}"):
            _job(**bad)


def test_replace_keeps_a_straggler_no_node_could_replace_and_says_so_once() -> None:
    """Only the job's own two nodes: quarantining the slow one would leave the job stuck in
    Placing, so it trains on, condition Straggler NotReplaced, one Warning Event."""
    job = Running(_job(action="replace"), nodes=NODES[:2])
    slow = job.status["placement"][1]
    events = []
    for step in (10, 20, 30, 45, 55):
        a = job.poll(step, {0: 0.1, 1: 0.3}, checkpoint=40 if step > 40 else None)
        assert not a.delete and job.status["phase"] == "Running"
        events += [e for e in a.events if e.reason == "StragglerNotReplaced"]
    assert not job.status.get("restartHistory") and not job.status.get("quarantinedNodes")
    cond = next(c for c in job.status["conditions"] if c["type"] == "Straggler")
    assert cond["status"] == "True" and cond["reason"] == "NotReplaced", cond
    assert f"node {slow} (rank 1)" in cond["message"] and "not replaced" in cond["message"]
    assert [e.type for e in events] == ["Warning"] and events[0].message == cond["message"]
