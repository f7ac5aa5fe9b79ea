"""End to end through `omni sandbox` and real kubectl, `scheduling.placement: scheduler`: the
pods are created naming no node, the sandbox's scheduler binds them, the operator gives each
its node rank from where they landed, and each standby supervisor starts its torchrun with it.
Then the node of rank 1 is lost: the next attempt is scheduled afresh on other nodes, and the
loss curve and samples of every step equal an uninterrupted run's."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import yaml

from omni_trainer.components.progress import read_step_log

from ..step_logs import read_step_samples
from .test_sandbox_e2e import (
    BIN,
    Sandbox,
    _fault,
    _manifest,
    _pods,
    last_logged_step,
    uninterrupted_run,
)

STEPS = 40
"""The node is lost past the checkpoint at step 10, while the job trains (about 0.3 to 0.6 s a
step here; rank 0 cannot go on without rank 1)."""
RANK = "omni.megascale.io/node-rank"


def test_scheduler_placed_pods_get_ranks_train_and_survive_a_lost_node(tmp_path: Path) -> None:
    _manifest(tmp_path / "job.yaml", step_log="runs/job/steps.jsonl", checkpoint="runs/job/ckpt",
              steps=STEPS)  # fmt: skip
    doc = yaml.safe_load((tmp_path / "job.yaml").read_text())
    doc["spec"].setdefault("scheduling", {})["placement"] = "scheduler"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    _manifest(tmp_path / "ref.yaml", step_log="runs/ref/steps.jsonl", checkpoint=None,
              steps=STEPS)  # fmt: skip
    log_path = tmp_path / "runs/job/steps.jsonl"
    watch_out = tmp_path / "pods.watch"
    with Sandbox(tmp_path) as sb, watch_out.open("w") as out, ExitStack() as stack:
        # every pod as the API server first sent it (created by the operator, before binding)
        watch = subprocess.Popen([str(BIN / "kubectl"), "get", "pods", "--watch-only", "-o",
                                  "json", "--output-watch-events"], cwd=tmp_path, env=sb.env,
                                 stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        stack.callback(watch.kill)
        sb.wait("kubectl's watch", lambda: _connected(watch), timeout=60)
        time.sleep(1)  # its watch request sent: every pod event from here on is seen
        sb.kubectl("apply", "-f", "job.yaml")

        def status() -> dict[str, Any]:
            return sb.job("tiny-cpu").get("status") or {}

        def logged() -> int:
            return last_logged_step(log_path)

        def attempt_pods(attempt: int) -> dict[str, dict[str, Any]]:
            prefix = f"tiny-cpu-a{attempt}-p"
            return {n: p for n, p in _pods(sb).items() if n.startswith(prefix)}

        def ranked(attempt: int) -> dict[str, dict[str, Any]] | None:
            pods = attempt_pods(attempt)
            ranks = sorted(p["metadata"]["labels"].get(RANK) or "" for p in pods.values())
            return pods if ranks == ["0", "1"] else None

        created = sb.wait("the pods as created", lambda: _first_seen(watch_out, 2), timeout=60)
        for pod in created.values():  # constraints, no node
            assert "nodeName" not in pod["spec"], pod["spec"]
            assert pod["metadata"]["labels"].get("omni.megascale.io/placement") == "scheduler"
            assert RANK not in pod["metadata"]["labels"], pod["metadata"]
            assert "podAntiAffinity" in pod["spec"]["affinity"], pod["spec"]
        pods = sb.wait("ranks of attempt 0", lambda: ranked(0), timeout=120)
        nodes = {p["spec"]["nodeName"] for p in pods.values()}
        assert len(nodes) == 2, pods  # one pod per node
        st = status()  # ranks given while the trainers import
        by_rank = {p["metadata"]["labels"][RANK]: p["spec"]["nodeName"] for p in pods.values()}
        assert st["placement"] == [by_rank["0"], by_rank["1"]], st
        placed = {c["type"]: c for c in st["conditions"]}["Placed"]
        assert placed["reason"] == "BoundByScheduler", placed
        lost = by_rank["1"]
        sb.wait("step 12 (a checkpoint at 10, steps to recompute)", lambda: logged() > 12,
                timeout=300)  # fmt: skip
        _fault(tmp_path, "node-lost", lost)
        faulted_at = logged()

        sb.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "otj/tiny-cpu",
                   "--timeout=300s", timeout=330)  # fmt: skip
        final = status()
        after = ranked(1)
        logs = {n: sb.kubectl("logs", n) for n in (after or {})}
    assert after is not None, final
    assert all(p["spec"]["nodeName"] != lost for p in after.values()), after
    assert final["restarts"] == 1 and final["attempt"] == 1 and lost not in final["placement"]
    (record,) = final["restartHistory"]
    assert (record["reason"], record["nodes"], record["mode"]) == ("NodeLost", [lost], "recreate")
    assert record["confirmed"] and record["lostSeconds"] > 0, record
    for name, pod in after.items():  # each standby supervisor started torchrun with its rank
        rank = pod["metadata"]["labels"][RANK]
        assert "starting attempt 1: " in logs[name] and f" --node-rank={rank} " in logs[name]
        if rank == "0":
            assert f"training {STEPS} steps" in logs[name], logs[name]

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["attempt"] for r in records} == {0, 1}
    lost_at = max(r["step"] for r in records if r["attempt"] == 0)
    assert faulted_at <= lost_at < STEPS, (faulted_at, lost_at)  # lost while it trained
    first = min(r["step"] for r in records if r["attempt"] == 1)
    assert record["fromStep"] == first - 1 >= 10, (record, first)
    got, want = read_step_log(log_path), uninterrupted_run(tmp_path)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
    assert read_step_samples(log_path) == read_step_samples(tmp_path / "runs/ref/steps.jsonl")


def _connected(proc: subprocess.Popen[Any]) -> bool:
    """The process holds an established TCP connection (kubectl's watch to the API server)."""
    try:
        return any(c.status == psutil.CONN_ESTABLISHED
                   for c in psutil.Process(proc.pid).net_connections("tcp"))  # fmt: skip
    except psutil.NoSuchProcess:
        return False


def _first_seen(path: Path, want: int) -> dict[str, dict[str, Any]] | None:
    """Each pod as the watch first reported it (its ADDED event: the object as created), once
    ``want`` pods were reported."""
    first: dict[str, dict[str, Any]] = {}
    for event in _events(path.read_text()):
        pod = event["object"]
        name = pod["metadata"]["name"]
        if name not in first:
            assert event["type"] == "ADDED", event  # the watch began after the pod's creation
            first[name] = pod
    return first if len(first) >= want else None


def _events(text: str) -> list[dict[str, Any]]:
    """The watch's JSON objects, concatenated (kubectl prints each indented, one after another)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while (i := _skip_space(text, i)) < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # an event still being written
        out.append(obj)
    return out


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
