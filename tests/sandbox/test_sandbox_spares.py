"""End to end through `omni sandbox`: a 2-node job with one hot spare on a 3-node sandbox loses
the node of rank 1; the spare's pod (scheduled and started long before) takes rank 1 over, the
other pod restarts in place, no pod is created for the rank, and the loss curve and samples of
every step equal an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from omni_trainer.components.progress import read_step_log, read_step_samples

from .test_sandbox_e2e import Sandbox, _fault, _manifest, _pods, uninterrupted_run

STEPS = 120
"""Long enough that the node loss lands while the job trains (about 0.3 s a step here)."""
SPARE = "tiny-cpu-s0"


def test_a_lost_node_continues_on_the_hot_spare(tmp_path: Path) -> None:
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt",
              steps=STEPS)  # fmt: skip
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    doc["spec"]["spareNodes"] = 1
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None,
              steps=STEPS)  # fmt: skip
    log_path = tmp_path / "runs/job/steps.jsonl"
    with Sandbox(tmp_path, nodes=3) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def status() -> dict[str, Any]:
            return sb.job("tiny-cpu").get("status") or {}

        def logged() -> int:  # the trainer's own last step: the status trails it
            lines = log_path.read_text().splitlines() if log_path.exists() else []
            return json.loads(lines[-1])["step"] if lines else 0

        sb.wait("a ready spare", lambda: [x["ready"] for x in status().get("spares", [])]
                == [True], timeout=300)  # fmt: skip
        sb.wait("step 12 (a checkpoint at 10, steps to recompute)", lambda: logged() > 12,
                timeout=400)  # fmt: skip
        before = _pods(sb)
        assert sorted(before) == ["tiny-cpu-a0-n0", "tiny-cpu-a0-n1", SPARE]
        lost = before["tiny-cpu-a0-n1"]["spec"]["nodeName"]
        spare_node = before[SPARE]["spec"]["nodeName"]
        assert spare_node not in (lost, before["tiny-cpu-a0-n0"]["spec"]["nodeName"])
        _fault(tmp_path, "node-lost", lost)
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=600s", timeout=660)  # fmt: skip
        final = status()
        after = _pods(sb)
    (record,) = final["restartHistory"]
    assert (record["mode"], record["reason"], record["nodes"]) == ("spare", "NodeLost", [lost])
    assert record["confirmed"] and record["lostSeconds"] > 0, record
    assert final["placement"][1] == spare_node and final["podAttempt"] == 0
    # no pod was created for the rank: the spare's pod (same UID) and rank 0's kept theirs
    for name in ("tiny-cpu-a0-n0", SPARE):
        assert after[name]["metadata"]["uid"] == before[name]["metadata"]["uid"], name
    labels = after[SPARE]["metadata"]["labels"]
    assert labels["omni.megascale.io/spare"] == "assigned"
    assert labels["omni.megascale.io/node-rank"] == "1"
    print(
        f"hot spare: NodeLost on {lost}, rank 1 on {spare_node}, "
        f"lost {record['lostSeconds']:.1f} s, recomputed {record['stepsRecomputed']} steps"
    )

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["attempt"] for r in records} == {0, 1}
    assert record["fromStep"] == min(r["step"] for r in records if r["attempt"] == 1) - 1
    got, want = read_step_log(log_path), uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
    assert read_step_samples(log_path) == read_step_samples(tmp_path / "runs/ref/steps.jsonl")
