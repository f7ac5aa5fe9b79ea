"""Straggler detection on hand-made sequences of per-node busy times, and what reconcile makes
of it: status.stragglers, condition Straggler, one Warning Event per detection."""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from omni_operator.reconcile import Observed, Progress, parse_status, reconcile
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


def test_reconcile_reports_a_straggler_once_with_a_condition_and_an_event() -> None:
    job = _job()
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    nodes = [node(f"n{i}") for i in range(4)]
    first = reconcile(Observed(job=job, status=parse_status(None), owned=[], nodes=nodes, now=now))
    status = first.status
    owned = []
    for o in first.create:
        if o["kind"] == "Pod":
            placed = o["metadata"]["annotations"]["omni.megascale.io/placed-node"]
            o = {**o, "spec": {**o["spec"], "nodeName": placed}, "status": {"phase": "Running"}}
        owned.append(o)
    events = []

    def poll(step: int, busy: dict[int, float]):
        progress = Progress(step=step, node_busy=busy)
        return reconcile(Observed(job=job, status=parse_status(status), owned=owned, nodes=nodes,
                                  now=now, progress=progress, tracks_progress=True))  # fmt: skip

    for step in (10, 20, 30, 40):
        a = poll(step, {0: 0.1, 1: 0.25})
        status = {**status, **a.status}
        events += [e for e in a.events if e.reason == "Straggler"]
    slow = status["placement"][1]
    (entry,) = status["stragglers"]
    assert entry["node"] == slow and entry["detectedStep"] == 30 and entry["slowSinceStep"] == 10
    cond = next(c for c in status["conditions"] if c["type"] == "Straggler")
    assert cond["status"] == "True" and cond["reason"] == "SlowNode"
    assert f"node {slow} (rank 1) busy 0.250 s per step, 2.50x" in cond["message"]
    assert [e.type for e in events] == ["Warning"] and slow in events[0].message  # once
    # it catches up: the condition clears
    a = poll(50, {0: 0.1, 1: 0.1})
    assert a.status["stragglers"] == []
    cond = next(c for c in a.status["conditions"] if c["type"] == "Straggler")
    assert cond["status"] == "False" and cond["reason"] == "NoStraggler"


def test_bad_settings_name_the_field() -> None:
    for bad, field in ((dict(margin=0), "margin"), (dict(action="evict"), "action"),
                       (dict(persistSteps=0), "persistSteps")):  # fmt: skip
        with pytest.raises(ManifestError, match=rf"spec.restartPolicy.stragglers.{field}"):
            _job(**bad)
