"""End to end through `omni sandbox` and real kubectl: a job of three nodes, one of whose
network is degraded (`omni sandbox fault degrade-network`: its pods stall in a duty cycle) while
the trainers start. The first attempt's network preflight names that node (PreflightFailed),
the operator quarantines it, spends no restart budget and places the gang on the others, whose
preflight passes; the job trains to Succeeded with the passing figures in its status."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from .test_sandbox_e2e import Sandbox, _fault, _manifest, _pods

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("OMNI_E2E_DEGRADED_NETWORK") != "1",
        reason="the sandbox's degrade-network fault (SIGSTOP duty cycles driven by the kubelet's "
        "event loop) does not slow a link reliably on a loaded machine: in two CI runs on 2 busy "
        "cores the degraded node read 0.82x and 1.0x the median; run it on a quiet machine with "
        "OMNI_E2E_DEGRADED_NETWORK=1 (detection itself: tests/dist/test_netcheck.py)",
    ),
]


def test_a_degraded_node_fails_the_preflight_and_is_replaced(tmp_path: Path) -> None:
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint=None, steps=10)
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    doc["spec"]["nodes"] = 3
    doc["spec"]["trainer"]["data"].update(globalBatchSize=12, loaderShards=3)  # 3 ranks
    # 20 exchanges span several duty cycles of the fault (a few alone could fit in one run).
    # The sandbox's fault stalls the node's processes, and on a loaded machine the kubelet's own
    # stop/continue cadence stretches: the degraded links then read only 10-20% slower (seen in
    # CI: 0.263 vs 0.32 GB/s), so the relative floor is set at 0.9 of the median here. With three
    # nodes the healthy two share their best link, which is the median.
    doc["spec"]["preflight"] = {
        "sizeMb": 2, "iterations": 20, "timeoutSeconds": 60, "minFractionOfMedian": 0.9,
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with Sandbox(tmp_path) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def running() -> dict | None:
            pods = _pods(sb)
            ok = len(pods) == 3 and all(
                (p.get("status") or {}).get("phase") == "Running" for p in pods.values()
            )
            return pods if ok else None

        pods = sb.wait("attempt 0's pods running", running, timeout=120)
        bad = pods["tiny-cpu-a0-n1"]["spec"]["nodeName"]
        _fault(tmp_path, "degrade-network", bad)  # the trainers are still importing
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=420s", timeout=480)  # fmt: skip
        status = sb.job("tiny-cpu")["status"]
        events = json.loads(sb.kubectl("get", "events", "-o", "json"))["items"]
        placed = {p["spec"]["nodeName"] for p in _pods(sb).values()}
    (record,) = status["restartHistory"]
    assert record["reason"] == "PreflightFailed" and record["nodes"] == [bad], record
    assert f"network preflight failed on node {bad}" in record["message"]
    assert status["quarantinedNodes"] == [bad] and bad not in placed
    assert status["restartBudgetLeft"] == 10  # the preflight named its node: not charged
    preflight = status["preflight"]
    figures = {x["node"]: x["gbps"] for x in preflight["nodes"]}
    assert preflight["verdict"] == "Passed" and sorted(figures) == sorted(placed)
    assert all(g > 0 for g in figures.values())
    assert preflight["allReduceGbps"] > 0 and preflight["seconds"] > 0
    warned = [e for e in events if e.get("reason") == "PreflightFailed"]
    assert warned and bad in warned[0]["message"]
    print(f"preflight cost {preflight['seconds']:.2f} s per attempt; figures {preflight}")
