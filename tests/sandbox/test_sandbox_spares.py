"""End to end through `omni sandbox`: a 2-node job with one hot spare on a 4-node sandbox loses
the node of rank 0 (the rendezvous host), then, once a new spare is ready, the node of rank 1.
Each time a spare's pod (scheduled and started long before) takes the rank over, the other pod
restarts in place, no pod is created for the rank, and the loss curve and samples of every step
equal an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from omni_trainer.components.progress import read_step_log

from ..step_logs import read_step_samples
from .test_sandbox_e2e import (
    RUN_IN_PLACE_STEPS,
    Sandbox,
    _fault,
    _manifest,
    _pods,
    last_logged_step,
    uninterrupted_run,
)

STEPS = RUN_IN_PLACE_STEPS
"""Long enough that both node losses land while the job trains (at steps 18 and 26, 0.3 s a
step, with the suite's sandbox tests alone; the second waits for a spare started after the
first), with the in-place test's margin."""
RANK = "omni.megascale.io/node-rank"


def test_lost_nodes_continue_on_hot_spares_rank_0_included(tmp_path: Path) -> None:
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt",
              steps=STEPS)  # fmt: skip
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    doc["spec"]["spareNodes"] = 1
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None,
              steps=STEPS)  # fmt: skip
    log_path = tmp_path / "runs/job/steps.jsonl"
    with Sandbox(tmp_path, nodes=4) as sb:
        sb.kubectl("apply", "-f", "job.yaml")

        def status() -> dict[str, Any]:
            return sb.job("tiny-cpu").get("status") or {}

        def logged() -> int:
            return last_logged_step(log_path)

        def spare_ready(name: str) -> bool:
            return [(x["pod"], x["ready"]) for x in status().get("spares", [])] == [(name, True)]

        swaps = []  # (rank, lost node, spare, spare's node, pods before)
        for rank, spare, past in ((0, "tiny-cpu-s0", 12), (1, "tiny-cpu-s1", None)):
            sb.wait(f"{spare} ready", lambda s=spare: spare_ready(s), timeout=300)
            if past is None:  # a checkpoint of the attempt the first swap started
                past = (logged() // 10 + 1) * 10 + 2
            sb.wait(f"step {past} (steps to recompute)", lambda p=past: logged() > p,
                    timeout=400)  # fmt: skip
            before = _pods(sb)
            by_rank = {p["metadata"]["labels"].get(RANK): n for n, p in before.items()}
            lost = before[by_rank[str(rank)]]["spec"]["nodeName"]
            swaps.append((rank, lost, spare, before[spare]["spec"]["nodeName"], before))
            _fault(tmp_path, "node-lost", lost)
            sb.wait(f"rank {rank} on {spare}", lambda s=spare, r=rank: (
                sb.job("tiny-cpu")["status"].get("placement") or [None, None])[r]
                == _pods(sb).get(s, {}).get("spec", {}).get("nodeName"), timeout=300)  # fmt: skip
        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=600s", timeout=660)  # fmt: skip
        final = status()
        after = _pods(sb)
        services = json.loads(sb.kubectl("get", "svc", "-o", "json"))["items"]
    assert [r["mode"] for r in final["restartHistory"]] == ["spare", "spare"], final
    assert final["podAttempt"] == 0 and final["placement"] == [swaps[0][3], swaps[1][3]]
    for record, (rank, lost, spare, spare_node, before) in zip(
        final["restartHistory"], swaps, strict=True
    ):
        assert (record["reason"], record["nodes"]) == ("NodeLost", [lost]), record
        assert record["confirmed"] and record["lostSeconds"] > 0, record
        # no pod was created for the rank: the spare's pod (same UID) took it over
        assert after[spare]["metadata"]["uid"] == before[spare]["metadata"]["uid"], spare
        labels = after[spare]["metadata"]["labels"]
        assert labels["omni.megascale.io/spare"] == "assigned" and labels[RANK] == str(rank)
        print(
            f"hot spare: NodeLost on {lost}, rank {rank} on {spare_node} ({spare}), "
            f"lost {record['lostSeconds']:.1f} s, recomputed {record['stepsRecomputed']} steps"
        )
    # the rendezvous Service of the pods' attempt, which selected the spare at rank 0
    assert sorted(s["metadata"]["name"] for s in services) == ["tiny-cpu", "tiny-cpu-a0-rdzv"]

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["attempt"] for r in records} == {0, 1, 2}
    for record in final["restartHistory"]:
        first = min(r["step"] for r in records if r["attempt"] == record["attempt"])
        assert record["fromStep"] == first - 1, record
    got, want = read_step_log(log_path), uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
    assert read_step_samples(log_path) == read_step_samples(tmp_path / "runs/ref/steps.jsonl")
