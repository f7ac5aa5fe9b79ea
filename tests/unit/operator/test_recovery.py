"""Failure classification and restart decisions (pure)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import yaml

from omni_operator.recovery.failures import (
    PEER_REPORT_GRACE_S,
    Failure,
    classify,
    next_deadline,
    node_lost,
)
from omni_operator.recovery.restarts import (
    backoff_seconds,
    decide_restart,
    quarantined_nodes,
    restarts_without_progress,
)
from omni_operator.render import ANNOTATION_NODE, LABEL_ATTEMPT, LABEL_RANK
from omni_operator.spec import OmniTrainingJobSpec, parse_job
from omni_operator.status import RestartRecord

from ...conftest import EXAMPLES
from .nodes import node

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def _iso(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec(**policy: Any) -> OmniTrainingJobSpec:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["spec"].update(nodes=2, gpusPerNode=0, restartPolicy=policy)
    return parse_job(doc).spec


def _pod(rank: int, phase: str = "Running", *, node: str | None = None, **status: Any) -> dict:
    return {
        "metadata": {
            "name": f"j-a0-n{rank}",
            "labels": {LABEL_RANK: str(rank), LABEL_ATTEMPT: "0"},
            "annotations": {ANNOTATION_NODE: node or f"n{rank}"},
        },
        "spec": {"nodeName": node or f"n{rank}"},
        "status": {"phase": phase, **status},
    }


def _exited(
    rank: int, code: int, *, at: float = 0, reason: str = "Error", message: str | None = None
) -> dict:
    term = {"exitCode": code, "reason": reason, "finishedAt": _iso(at)}
    if message is not None:
        term["message"] = message
    return _pod(
        rank,
        "Failed" if code else "Succeeded",
        containerStatuses=[{"name": "trainer", "state": {"terminated": term}}],
    )


def _nodes(*names: str, not_ready: dict[str, float] | None = None) -> dict[str, dict]:
    out = {}
    for name in names:
        n = node(name)
        if name in (not_ready or {}):
            n["status"]["conditions"] = [
                {
                    "type": "Ready",
                    "status": "Unknown",
                    "lastTransitionTime": _iso((not_ready or {})[name]),
                }
            ]
        out[name] = n
    return out


def _classify(pods: list[dict], nodes: dict | None = None, **kw: Any) -> Failure | None:
    kw.setdefault("spec", _spec())
    kw.setdefault("last_progress_time", None)
    kw.setdefault("started_steps", True)
    return classify(pods, _nodes("n0", "n1") if nodes is None else nodes, now=NOW, **kw)


def test_healthy_and_pending_pods_are_no_failure() -> None:
    assert _classify([_pod(0), _pod(1)]) is None
    assert _classify([_pod(0, "Pending"), _pod(1, "Pending")]) is None
    assert _classify([_exited(0, 0), _pod(1)]) is None  # rank 0 finished first: fine


def test_node_not_ready_counts_only_after_the_grace() -> None:
    pods = [_pod(0), _pod(1)]
    assert _classify(pods, _nodes("n0", "n1", not_ready={"n1": 30})) is None  # grace 60
    f = _classify(pods, _nodes("n0", "n1", not_ready={"n1": 61}))
    assert f is not None and f.kind == "node_lost" and f.nodes == ("n1",)
    assert f.pods == ("j-a0-n1",) and "unreachable (Ready=Unknown) for 61 s" in f.message
    assert f.reason == "NodeLost" and f.retryable


def test_peers_failing_while_a_node_is_not_ready_blame_the_node_at_once() -> None:
    flaky = _nodes("n0", "n1", not_ready={"n1": 3})  # within the grace of 60 s
    assert _classify([_pod(0), _pod(1)], flaky) is None  # no failure yet: wait for the grace
    f = _classify([_exited(0, 1), _pod(1)], flaky)  # rank 0 lost its peer
    assert f is not None and f.kind == "node_lost" and f.nodes == ("n1",)
    assert "node n1 is unreachable (Ready=Unknown) and its peers failed" in f.message
    f = _classify([_exited(0, 1), _pod(1)])  # the same crash with every node Ready
    assert f is not None and f.kind == "pod_failed" and f.nodes == ("n0",)


def test_next_deadline_is_the_earliest_grace_or_hang_timeout() -> None:
    pods = [_pod(0), _pod(1)]
    spec = _spec(hangTimeoutSeconds=600)  # nodeLostGraceSeconds 60
    healthy = _nodes("n0", "n1")
    assert next_deadline(pods, healthy, spec=spec, now=NOW, last_progress_time=None) is None
    progress = NOW - dt.timedelta(seconds=100)
    assert next_deadline(pods, healthy, spec=spec, now=NOW, last_progress_time=progress) == 500
    flaky = _nodes("n0", "n1", not_ready={"n1": 45})
    assert next_deadline(pods, flaky, spec=spec, now=NOW, last_progress_time=progress) == 15
    gone = _nodes("n0", "n1", not_ready={"n1": 90})  # past the grace: due now
    assert next_deadline(pods, gone, spec=spec, now=NOW, last_progress_time=None) == 0


def test_missing_node_is_lost_and_wins_over_the_failures_it_causes() -> None:
    pods = [_exited(0, 1), _pod(1)]
    f = _classify(pods, _nodes("n0"))
    assert f is not None and f.kind == "node_lost" and "n1 no longer exists" in f.message


def test_not_ready_without_transition_time_counts_as_lost() -> None:
    n = node("n1", ready=False)
    assert "NotReady" in (node_lost("n1", {"n1": n}, spec=_spec(), now=NOW) or "")
    assert node_lost(None, {}, spec=_spec(), now=NOW) is None


def test_eviction() -> None:
    evicted = _pod(1, "Failed", reason="Evicted", message="low on memory")
    f = _classify([_pod(0), evicted])
    assert f is not None and f.kind == "pod_evicted" and f.nodes == ("n1",)
    assert "low on memory" in f.message
    preempted = _pod(
        1,
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
        ],
    )
    f = _classify([_pod(0), preempted])
    assert f is not None and f.kind == "pod_evicted"


def test_failed_pod_blames_the_first_to_fail() -> None:
    f = _classify([_exited(0, 1, at=5), _exited(1, 137, at=10, reason="OOMKilled")])
    assert f is not None and f.kind == "pod_failed" and f.exit_code == 137
    assert f.nodes == ("n1",) and "OOMKilled" in f.message and "1 more pods" in f.message


def test_failed_pod_without_container_status() -> None:
    f = _classify([_pod(0, "Failed"), _pod(1)])
    assert f is not None and f.kind == "pod_failed" and f.exit_code is None
    assert "no exit code" in f.message


def test_non_retryable_exit_code_is_a_user_error() -> None:
    f = _classify([_exited(0, 3), _pod(1)], spec=_spec(nonRetryableExitCodes=[3]))
    assert f is not None and f.kind == "user_error" and not f.retryable and f.exit_code == 3
    assert "nonRetryableExitCodes" in f.message


def test_crash_before_the_first_step_is_a_user_error_only_when_known() -> None:
    f = _classify([_exited(0, 1), _pod(1)], started_steps=False)
    assert (
        f is not None and f.kind == "user_error" and "before the first training step" in f.message
    )
    f = _classify([_exited(0, 1), _pod(1)], started_steps=None)
    assert f is not None and f.kind == "pod_failed"


def test_the_termination_message_is_the_cause() -> None:
    """The first failed pod's termination message (its trainer's fatal error) ends every
    message; a peer's, when the first has none."""
    cause = "rank 0: FileNotFoundError: source 'web': url '/data/*.tar' matches no .tar shards"
    f = _classify([_exited(0, 1, message=cause), _pod(1)], started_steps=False)
    assert (
        f is not None and f.kind == "user_error" and f.message.endswith(f"not restarted: {cause}")
    )
    early = "rank 1: RuntimeError: CUDA error: an illegal memory access was encountered"
    f = _classify([_exited(0, 1, at=1, message=cause), _exited(1, 1, at=9, message=early)])
    assert f is not None and f.message.endswith(f": {early}")  # the first to fail is rank 1
    f = _classify([_exited(0, 1, at=1, message=cause), _exited(1, 137, at=9)])
    assert f is not None and f.message.endswith(f": {cause}")
    f = _classify([_exited(0, 3, message=cause), _pod(1)], spec=_spec(nonRetryableExitCodes=[3]))
    assert f is not None and f.message.endswith(f"not restarted: {cause}")


@pytest.mark.parametrize(
    "after_a_peer",
    [
        "rank 0: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:5258. This is typically caused by a remote worker crashing.",
        "rank 0: RuntimeError: NCCL communicator was aborted on rank 0: remote process exited "
        "or there was a network error",
        "rank 0: torch.distributed.DistNetworkError: failed to recv, got 0 bytes",
        "rank 0: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "1800000ms for recv operation to complete. This is typically caused by a remote worker "
        "hanging or bugs in the application.",
    ],
)
def test_a_trainer_that_failed_on_its_peer_is_not_blamed(after_a_peer: str) -> None:
    """Rank 1's worker is killed; rank 0's fails on the broken collective within milliseconds
    and its termination lands a second earlier (whole seconds). Rank 1 is the cause: its node
    is the one counted, its failure the one named."""
    peer = _exited(0, 1, at=2, message=after_a_peer)
    f = _classify([peer, _exited(1, 1, at=1, message="[attempt 0] the trainer exited with code 1")])
    assert f is not None and f.kind == "pod_failed" and f.pods == ("j-a0-n1",), f
    assert f.nodes == ("n1",) and f.message.startswith("pod j-a0-n1 (node rank 1)"), f
    assert "1 more pods failed after it" in f.message
    both = _classify([peer, _exited(1, 1, at=1, message=after_a_peer.replace("rank 0", "rank 1"))])
    assert both is not None and both.pods == ("j-a0-n0",)  # all say so: the earliest


def test_a_failure_after_a_peer_waits_a_moment_for_the_crash_it_follows() -> None:
    """Only rank 0 has failed, saying its peer went first, and rank 1 still runs: rank 1's own
    failure is on its way (its trainer crashed, its report comes a moment later), so nothing is
    classified yet. Without that report within the grace, rank 0 is blamed as before; a
    failure of its own is classified at once."""
    msg = "rank 0: RuntimeError: Connection closed by peer [127.0.0.1]:5258"
    waiting = [_exited(0, 1, at=2, message=msg), _pod(1)]
    assert _classify(waiting) is None
    # no event may come: the reconcile is due again when the grace ends
    due = next_deadline(waiting, _nodes("n0", "n1"), spec=_spec(), now=NOW, last_progress_time=None)
    assert due == PEER_REPORT_GRACE_S - 2
    late = _classify([_exited(0, 1, at=PEER_REPORT_GRACE_S + 1, message=msg), _pod(1)])
    assert late is not None and late.kind == "pod_failed" and late.pods == ("j-a0-n0",)
    own = _classify([_exited(0, 1, at=2, message="rank 0: ValueError: bad batch"), _pod(1)])
    assert own is not None and own.pods == ("j-a0-n0",)


def test_missing_or_deleted_pod() -> None:
    f = _classify([_pod(0)])
    assert f is not None and f.kind == "pod_deleted" and "rank 1 is gone" in f.message
    going = _pod(1)
    going["metadata"]["deletionTimestamp"] = _iso(1)
    f = _classify([_pod(0), going])
    assert f is not None and f.kind == "pod_deleted" and f.pods == ("j-a0-n1",)


def test_hang_needs_running_pods_and_a_progress_clock() -> None:
    spec = _spec(hangTimeoutSeconds=600)
    pods = [_pod(0), _pod(1)]
    stale = NOW - dt.timedelta(seconds=601)
    f = _classify(pods, spec=spec, last_progress_time=stale)
    assert f is not None and f.kind == "hang" and "601 s" in f.message
    assert _classify(pods, spec=spec, last_progress_time=NOW - dt.timedelta(seconds=599)) is None
    assert _classify(pods, spec=spec, last_progress_time=None) is None
    assert _classify([_pod(0), _pod(1, "Pending")], spec=spec, last_progress_time=stale) is None


def _record(from_step: int | None, *nodes: str) -> RestartRecord:
    return RestartRecord(attempt=1, reason="PodFailed", nodes=list(nodes), from_step=from_step)


FAIL = Failure("pod_failed", "pod x failed", nodes=("n1",))


def test_backoff_doubles_up_to_the_cap() -> None:
    spec = _spec(backoffSeconds={"base": 10, "max": 60})
    assert [backoff_seconds(n, spec) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]


def test_restart_with_backoff_and_a_record() -> None:
    spec = _spec(budget=3, backoffSeconds={"base": 10, "max": 600})
    d = decide_restart([_record(100)], FAIL, spec, NOW, 100, attempt=1)
    assert d.action == "restart" and d.delay_seconds == 20 and d.budget_left == 1
    assert d.restart_at == NOW + dt.timedelta(seconds=20) and d.from_step == 100
    assert d.record is not None and d.record.attempt == 2 and d.record.nodes == ["n1"]
    assert "attempt 2 from the newest checkpoint (step 100 or newer) in 20 s" in d.message


def test_a_newer_checkpoint_refills_the_budget() -> None:
    spec = _spec(budget=2)
    history = [_record(None), _record(100), _record(100)]
    assert restarts_without_progress(history, 100) == 2
    assert decide_restart(history, FAIL, spec, NOW, 100).action == "fail"
    d = decide_restart(history, FAIL, spec, NOW, 200)
    assert d.action == "restart" and d.budget_left == 1 and d.delay_seconds == 10


def test_budget_exhausted_fails_with_the_last_failure() -> None:
    d = decide_restart([_record(None)], FAIL, _spec(budget=1), NOW, None)
    assert d.action == "fail" and d.reason == "RestartBudgetExhausted"
    assert "1 restart from the start" in d.message and "pod x failed" in d.message
    d = decide_restart([], FAIL, _spec(budget=0), NOW, None)
    assert d.action == "fail"


def test_user_error_fails_at_once() -> None:
    f = Failure("user_error", "exit code 3", exit_code=3)
    d = decide_restart([], f, _spec(), NOW, None)
    assert d.action == "fail" and d.reason == "UserError" and d.record is None


LOST = Failure("node_lost", "node n1 is NotReady", nodes=("n1",))


def _lost(*nodes: str, ago: float = 60) -> RestartRecord:
    return RestartRecord(attempt=1, reason="NodeLost", nodes=list(nodes), time=_iso(ago))


@pytest.mark.parametrize(("threshold", "expected"), [(1, ("n1", "n2")), (2, ("n1",)), (3, ())])
def test_quarantine_threshold(threshold: int, expected: tuple[str, ...]) -> None:
    policy = _spec(quarantineAfterFailures=threshold).restart_policy
    history = [_lost("n1"), _lost("n2")]
    assert quarantined_nodes(history, LOST, policy=policy, now=NOW) == expected
    crashes = [_record(None, "n1"), _record(None, "n2")]  # the trainer's own: never counted
    assert quarantined_nodes(crashes, FAIL, policy=policy, now=NOW) == ()
    old = [_lost("n1", ago=3601), _lost("n2", ago=3601)]  # outside quarantineSeconds
    assert quarantined_nodes(old, LOST, policy=policy, now=NOW) == expected[:1] * (threshold == 1)


def test_quarantine_is_sticky_and_named_in_the_decision() -> None:
    spec = _spec(quarantineAfterFailures=2)
    d = decide_restart([_lost("n1")], LOST, spec, NOW, 5, quarantined=["n7"])
    assert d.quarantine == ("n1", "n7") and "quarantined node n1" in d.message
    d = decide_restart([_record(None, "n1")], FAIL, spec, NOW, 5, quarantined=["n7"])
    assert d.quarantine == ("n7",)  # two crashes of the trainer on n1: not the node's fault
