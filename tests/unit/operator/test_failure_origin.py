"""Infrastructure, node and application failures told apart (pure): each kind of end, before
the first step and after it."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator.failure_origin import blames_nodes, device_error, infrastructure_cause
from omni_operator.recovery.restarts import decide_restart

from .test_recovery import NOW, _classify, _exited, _nodes, _pod, _spec

KUBELET_LOST = {"reason": "ContainerStatusUnknown", "message": "the container could not be located"}


@pytest.mark.parametrize("started", [False, True, None])
@pytest.mark.parametrize(
    ("pods", "nodes", "kind"),
    [
        # a kubelet (or the whole cluster) restarted: the container's state is gone
        ([_exited(0, 137, **KUBELET_LOST), _pod(1)], None, "container_lost"),
        # the node shut down under the pod (graceful node shutdown)
        (
            [_pod(0, "Failed", reason="Shutdown", message="Node is shutting down"), _pod(1)],
            None,
            "container_lost",
        ),
        # SIGKILL from outside the trainer (runtime, node agent, an operator)
        ([_exited(0, 137), _pod(1)], None, "pod_failed"),
        # the node went NotReady (within its grace) and its peer failed
        ([_exited(0, 1), _pod(1)], _nodes("n0", "n1", not_ready={"n1": 3}), "node_lost"),
        # the node is gone
        ([_pod(0), _pod(1)], _nodes("n0"), "node_lost"),
        # evicted (node pressure)
        (
            [_pod(0), _pod(1, "Failed", reason="Evicted", message="low on memory")],
            None,
            "pod_evicted",
        ),
        # a device error names the node
        (
            [
                _exited(
                    0,
                    1,
                    message="rank 0: RuntimeError: NCCL WARN NET/IB : Got completion with error 12",
                ),
                _pod(1),
            ],
            None,
            "device_error",
        ),
    ],
)
def test_infrastructure_failures_restart_at_any_step(
    pods: list[dict[str, Any]], nodes: dict | None, kind: str, started: bool | None
) -> None:
    f = _classify(pods, nodes, started_steps=started)
    assert f is not None and f.kind == kind and f.retryable, f
    d = decide_restart([], f, _spec(), NOW, None, attempt=0)
    assert d.action == "restart" and d.budget_left == _spec().restart_policy.budget - 1, d


@pytest.mark.parametrize(
    ("code", "reason", "message"),
    [
        (1, "Error", "rank 0: ValueError: model.hidden must divide heads"),
        (137, "OOMKilled", ""),  # the job's own memory limit
        (139, "Error", "Segmentation fault"),
    ],
)
def test_the_trainers_own_end_before_the_first_step_is_a_user_error(
    code: int, reason: str, message: str
) -> None:
    f = _classify([_exited(0, code, reason=reason, message=message), _pod(1)], started_steps=False)
    assert f is not None and f.kind == "user_error" and not f.retryable
    assert "before the first training step" in f.message
    after = _classify([_exited(0, code, reason=reason, message=message), _pod(1)])
    assert after is not None and after.kind == "pod_failed" and after.retryable


def test_lost_container_message_says_infrastructure() -> None:
    f = _classify([_exited(1, 137, **KUBELET_LOST), _pod(0)], started_steps=False)
    assert f is not None and f.reason == "ContainerLost" and f.nodes == ("n1",)
    assert "was lost (ContainerStatusUnknown, exit code 137)" in f.message
    assert "an infrastructure failure, not the trainer's; restarting" in f.message


def test_only_node_faults_blame_nodes() -> None:
    for reason in ("NodeLost", "DeviceError", "Straggler", "PreflightFailed"):
        assert blames_nodes(reason)
    for reason in ("PodFailed", "ContainerLost", "PodEvicted", "Hang", "UserError", "PodDeleted"):
        assert not blames_nodes(reason)


def test_origin_helpers() -> None:
    assert infrastructure_cause(137, "OOMKilled") is None
    assert infrastructure_cause(1, "Error", "Traceback") is None
    assert infrastructure_cause(None, "NodeLost") == "was lost (NodeLost)"
    assert device_error("x\nCUDA error: uncorrectable ECC error encountered\ny") == (
        "CUDA error: uncorrectable ECC error encountered"
    )
    assert device_error("RuntimeError: CUDA error: device-side assert triggered") is None
