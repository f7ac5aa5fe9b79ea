"""A failed network preflight: classified before the crash rules, its named nodes quarantined at
once, the restart not charged to the budget when it named them."""

from __future__ import annotations

from omni_operator.recovery.restarts import decide_restart, restarts_without_progress
from omni_operator.status import RestartRecord
from omni_trainer.distributed.netcheck_rules import (
    EXIT_PREFLIGHT,
    PreflightConfig,
    PreflightResult,
    failure_message,
    judge,
)

from .test_recovery import NOW, _classify, _exited, _nodes, _pod, _spec

RING = {("n0", "n1"): 10.0, ("n1", "n2"): 1.0, ("n2", "n0"): 1.1}


def test_preflight_failure_names_the_slow_node_even_before_the_first_step() -> None:
    message = failure_message(judge(["n0", "n1", "n2"], RING, PreflightConfig()))
    pods = [_exited(r, EXIT_PREFLIGHT, message=message) for r in range(3)]
    f = _classify(pods, _nodes("n0", "n1", "n2"), started_steps=False)
    assert f is not None and f.reason == "PreflightFailed" and f.nodes == ("n2",)
    assert "n2 1.1 GB/s" in f.message and f.retryable


def test_two_node_preflight_names_both_but_blames_none() -> None:
    result = judge(["n0", "n1"], {("n0", "n1"): 1.0}, PreflightConfig(min_bandwidth_gbps=5))
    pods = [_exited(0, EXIT_PREFLIGHT, message=failure_message(result)), _pod(1)]
    f = _classify(pods, started_steps=False)
    assert f is not None and f.reason == "PreflightFailed" and f.nodes == ()
    assert "n0, n1" in f.message and "cannot be told" in f.message


def test_a_silent_node_named_by_its_neighbour_is_quarantined_at_once_without_budget() -> None:
    alone = PreflightResult(nodes={"n1": None}, failed=["n1"], complete=False)
    f = _classify([_exited(0, EXIT_PREFLIGHT, message=failure_message(alone)), _pod(1)])
    assert f is not None and f.nodes == ("n1",) and "n1 no answer" in f.message
    spec = _spec(quarantineAfterFailures=3)
    d = decide_restart([], f, spec, NOW, None)
    assert d.action == "restart" and d.quarantine == ("n1",)
    assert restarts_without_progress([d.record], None) == 0  # named its node: not charged
    unnamed = RestartRecord(attempt=1, reason="PreflightFailed", message="", time="t", nodes=[])
    assert restarts_without_progress([unnamed], None) == 1
