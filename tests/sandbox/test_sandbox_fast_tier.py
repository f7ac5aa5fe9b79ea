"""End to end through `omni sandbox`: a node is lost after a fast-tier save newer than any
persistent one; the restart resumes from the fast step (its lost share copied back from the
peer node's disk), recomputes fewer steps than the persistent tier alone would, and the loss
curve equals an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from omni_trainer.components.progress import read_step_log

from .test_sandbox_e2e import SANDBOX_DIR, Sandbox, _fault, _manifest, uninterrupted_run

STEPS = 60
"""Long enough that the node loss lands while the job trains: the fault follows the second
fast save (step 8) within a poll of the node's disk and the kubelet's watch (a few seconds, at
0.1-0.3 s a step here). Its learning rate decays over these steps and its uninterrupted run is
this long: it runs in the other test lane, where no test trains a longer one."""
FAST = 4


def test_a_lost_node_resumes_from_the_fast_tier_of_its_peer(tmp_path: Path) -> None:
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt",
              steps=STEPS, decay_steps=STEPS)  # fmt: skip
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    doc["spec"]["trainer"]["checkpoint"].update(
        intervalSteps=1000, fast={"path": "/var/lib/omni-fast", "intervalSteps": FAST}
    )  # the persistent tier never saves before the fault: only the fast tier can help
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None,
              steps=STEPS, decay_steps=STEPS)  # fmt: skip
    log_path = tmp_path / "runs/job/steps.jsonl"
    with Sandbox(tmp_path) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def placed() -> str | None:
            pods = json.loads(sb.kubectl("get", "pods", "-l", selector, "-o", "json"))["items"]
            return pods[0]["spec"].get("nodeName") if pods else None

        selector = "omni.megascale.io/attempt=0,omni.megascale.io/node-rank=1"
        lost = sb.wait("rank 1's pod on a node", placed, timeout=200)
        disk = tmp_path / SANDBOX_DIR / "nodes" / lost

        def fast_saved() -> int | None:  # read off the node's disk: the status trails
            steps = [int(m.parent.name.split("-")[1]) for m in disk.rglob("COMMITTED")]
            return max(steps) if steps and max(steps) >= 2 * FAST else None

        saved = sb.wait("two fast-tier checkpoints on the node", fast_saved, timeout=400)
        _fault(tmp_path, "node-lost", lost)
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=600s", timeout=660)  # fmt: skip
        restart = sb.job("tiny-cpu")["status"]["restartHistory"][0]
        assert restart["reason"] == "NodeLost" and restart["nodes"] == [lost]
        assert not any(disk.rglob("COMMITTED"))  # its disk went with it
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    resumed = min(r["step"] for r in records if r["attempt"] == 1) - 1
    reached = max(r["step"] for r in records if r["attempt"] == 0)
    assert resumed >= saved and resumed % FAST == 0  # a fast step; without it: step 0
    assert restart["fromStep"] == resumed, restart
    assert reached - resumed < reached  # fewer steps recomputed than from the start
    first = {r["step"]: (r["loss"], r["samples"]) for r in records if r["attempt"] == 0}
    again = {r["step"]: (r["loss"], r["samples"]) for r in records if r["attempt"] == 1}
    recomputed = sorted(set(first) & set(again))
    assert recomputed and all(first[s] == again[s] for s in recomputed)  # bit-identical
    print(f"fast tier: resumed at {resumed}, reached {reached}: {reached - resumed} recomputed "
          f"(persistent tier alone: {reached})")  # fmt: skip

    got = read_step_log(log_path)
    want = uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
