"""The operator reads failed attempts from the supervisors of unready in-place pods: a real
supervisor report server, and the pods it asks (only running, unready, probed ones)."""

from __future__ import annotations

import asyncio
import json

from omni_operator.reports import SupervisorReports, reporting
from omni_trainer.failure_report import FailureReport, failure


def _pod(name: str, *, ready: bool, state: str = "running", probed: bool = True,
         order: int = 3) -> dict:  # fmt: skip
    container: dict = {"name": "trainer"}
    if probed:
        container["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "supervisor"}}
    cs = {"name": "trainer", "ready": ready, "state": {state: {}}}
    status = {"phase": "Running", "podIP": "127.0.0.1", "containerStatuses": [cs]}
    orders = {"omni.megascale.io/order": json.dumps({"attempt": order, "pods": 0})}
    meta = {"name": name, "uid": f"uid-{name}", "annotations": orders}
    return {"metadata": meta, "spec": {"containers": [container]}, "status": status}


def test_only_running_unready_probed_pods_are_asked() -> None:
    assert reporting(_pod("a", ready=False)) == "http://127.0.0.1:9465"
    assert reporting(_pod("b", ready=True)) is None
    assert reporting(_pod("c", ready=False, state="waiting")) is None  # ended: its status says
    assert reporting(_pod("d", ready=False, probed=False)) is None  # an older operator's pod


def test_the_report_of_a_failed_attempt_is_read_and_a_healthy_one_is_none() -> None:
    report = FailureReport(0, "127.0.0.1").start()
    try:
        pods = [_pod("p", ready=False)]
        source = SupervisorReports(port=report.port, timeout_s=2.0)  # a free port here

        def read() -> dict:
            return asyncio.run(source(pods))

        assert read() == {}  # healthy (or starting): nothing
        report.set(failure(3, 1, "[attempt 3] RuntimeError: boom"))
        got = read()
        assert got["p"]["exitCode"] == 1 and got["p"]["message"] == "[attempt 3] RuntimeError: boom"
        assert got["p"]["attempt"] == 3 and got["p"]["finishedAt"].endswith("Z")
    finally:
        report.stop()
    # Read once per pod and order: the report stands (the server is gone now) ...
    assert read()["p"]["message"] == "[attempt 3] RuntimeError: boom"
    pods[:] = [_pod("p", ready=False, order=4)]  # ... until the operator orders attempt 4
    assert read() == {}  # gone: no news is no failure
