"""The in-pod supervisor: restarts its trainer for each attempt the operator names, reports
(tagged) when its trainer fails first, over HTTP or by exiting, and waits for the next attempt."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from omni_trainer.failure_report import FAILURE_PATH, HEALTH_PATH, FailureReport
from omni_trainer.pod_protocol import order, read_target, tag, untag
from omni_trainer.supervisor import Supervisor, decide, for_target


def test_decide() -> None:
    assert decide(target=None, ran=None, running=False, exit_code=None) == "wait"
    assert decide(target=0, ran=None, running=False, exit_code=None) == "start"
    assert decide(target=0, ran=0, running=True, exit_code=None) == "wait"
    assert decide(target=1, ran=0, running=True, exit_code=None) == "restart"
    assert decide(target=0, ran=0, running=False, exit_code=1) == "exit"  # failed first
    assert decide(target=1, ran=0, running=False, exit_code=1) == "start"  # ordered already
    assert decide(target=0, ran=0, running=False, exit_code=None) == "wait"  # restarted container
    assert decide(target=1, ran=0, running=False, exit_code=0) == "exit"  # trained to the end


def test_orders_and_tags(tmp_path: Path) -> None:
    path = tmp_path / "attempt"
    assert read_target(path, pods=0) is None
    path.write_text(order(3, pods=1))
    target = read_target(path, pods=1)
    assert target is not None and (target.attempt, target.env, target.fresh) == (3, {}, False)
    assert read_target(path, pods=0) is None  # other pods'
    assert read_target(path, pods=1, pod="job-s0", standby=True) is None  # a spare waits
    path.write_text('{"attempt": 3')
    assert read_target(path, pods=1) is None  # partial
    assert untag(tag(4, "rank 1: RuntimeError: x")) == (4, "rank 1: RuntimeError: x")
    assert untag("RuntimeError: x") == (None, "RuntimeError: x")


def test_a_spare_takes_the_rank_its_order_names(tmp_path: Path) -> None:
    path = tmp_path / "attempt"
    rank = {"OMNI_NODE_RANK": "1", "OMNI_PIPELINE_STAGES": "0"}
    path.write_text(order(4, pods=2, spares={"job-s0": rank}, fresh=True))
    spare = read_target(path, pods=2, pod="job-s0", standby=True)
    assert spare is not None and (spare.attempt, dict(spare.env), spare.fresh) == (4, rank, True)
    survivor = read_target(path, pods=2, pod="job-a2-n0")
    assert survivor is not None and (survivor.attempt, dict(survivor.env)) == (4, {})
    command = ["torchrun", "--nnodes=2", "--node-rank=-1", "--rdzv-id=attempt-2", "-m", "x"]
    assert for_target(command, spare) == [
        "torchrun", "--nnodes=2", "--node-rank=1", "--rdzv-id=attempt-4", "-m", "x"]  # fmt: skip
    assert for_target(command, survivor) == [
        "torchrun", "--nnodes=2", "--node-rank=-1", "--rdzv-id=attempt-4", "-m", "x"]  # fmt: skip
    assert for_target(["python", "t.py"], spare) == ["python", "t.py"]  # no torchrun flags


def test_a_standby_starts_its_trainer_only_when_assigned(tmp_path: Path) -> None:
    """It waits (no trainer) through orders for the gang, then runs the assigned rank."""
    (tmp_path / "attempt").write_text(order(0, pods=0))
    body = "open(sys.argv[1], 'w').write(os.environ['OMNI_NODE_RANK'] + ' ' + sys.argv[2])"
    command = [*_script(tmp_path, body), str(tmp_path / "rank.txt"), "--node-rank=-1"]
    sup = Supervisor(command, attempt_file=tmp_path / "attempt", state_dir=tmp_path / "state",
                     pods=0, pod="job-s0", standby=True, poll_s=0.05)  # fmt: skip
    assign = order(1, pods=0, spares={"job-s0": {"OMNI_NODE_RANK": "1"}}, fresh=True)
    threading.Timer(1.0, lambda: (tmp_path / "attempt").write_text(assign)).start()
    assert sup.run() == 0
    assert _runs(tmp_path) == ["1"]  # never ran attempt 0
    assert (tmp_path / "rank.txt").read_text() == "1 --node-rank=1"


def _script(tmp_path: Path, body: str) -> list[str]:
    """A 'trainer' that appends its attempt to runs.txt, then runs ``body``."""
    runs = tmp_path / "runs.txt"
    code = (f"import os, sys, time\nopen({str(runs)!r}, 'a').write("
            f"os.environ['OMNI_RESTART_ATTEMPT'] + '\\n')\n{body}")  # fmt: skip
    return [sys.executable, "-c", code]


def _runs(tmp_path: Path) -> list[str]:
    path = tmp_path / "runs.txt"
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def termination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    path.write_bytes(b"")
    monkeypatch.setenv("OMNI_TERMINATION_LOG", str(path))
    return path


def test_a_failed_trainer_ends_the_container_tagged_and_a_restart_waits(
    tmp_path: Path, termination: Path
) -> None:
    (tmp_path / "attempt").write_text(order(2, pods=0))
    body = "open(os.environ['OMNI_TERMINATION_LOG'], 'w').write('ValueError: bad'); sys.exit(3)"
    sup = Supervisor(_script(tmp_path, body), attempt_file=tmp_path / "attempt",
                     state_dir=tmp_path / "state", poll_s=0.02)  # fmt: skip
    assert sup.run() == 3
    assert termination.read_text() == "[attempt 2] ValueError: bad"
    # The kubelet restarts the container: the new supervisor waits for a newer attempt.
    again = Supervisor(_script(tmp_path, "pass"), attempt_file=tmp_path / "attempt",
                       state_dir=tmp_path / "state", poll_s=0.02)  # fmt: skip
    threading.Timer(0.5, lambda: (tmp_path / "attempt").write_text(order(3, pods=0))).start()
    start = time.monotonic()
    assert again.run() == 0 and time.monotonic() - start >= 0.5
    assert _runs(tmp_path) == ["2", "3"]


def test_with_a_report_port_a_failure_is_served_and_the_container_lives_on(
    tmp_path: Path, termination: Path
) -> None:
    """The failed attempt turns /healthz to 503 and /failure tells it tagged; the supervisor
    keeps running, starts the next attempt the operator orders, and that clears the report."""
    (tmp_path / "attempt").write_text(order(4, pods=0))
    body = ("if os.environ['OMNI_RESTART_ATTEMPT'] == '4':\n"
            "    open(os.environ['OMNI_TERMINATION_LOG'], 'w').write('RuntimeError: nccl')\n"
            "    sys.exit(1)\n"
            "time.sleep(1.0)\n")  # fmt: skip
    report = FailureReport(0, "127.0.0.1").start()
    sup = Supervisor(_script(tmp_path, body), attempt_file=tmp_path / "attempt",
                     state_dir=tmp_path / "state", poll_s=0.02, report=report)  # fmt: skip
    seen: dict[str, object] = {}

    def operator() -> None:
        url = f"http://127.0.0.1:{report.port}"
        seen["healthy"] = _status(url + HEALTH_PATH)
        while _status(url + HEALTH_PATH) != 503:
            time.sleep(0.02)
        with urllib.request.urlopen(url + FAILURE_PATH) as resp:
            seen["failure"] = json.loads(resp.read())
        (tmp_path / "attempt").write_text(order(5, pods=0))
        while _runs(tmp_path)[-1:] != ["5"]:
            time.sleep(0.02)
        seen["after"] = _status(url + HEALTH_PATH)

    thread = threading.Thread(target=operator)
    thread.start()
    assert sup.run() == 0  # attempt 5 trained to the end: the container ends, and only then
    thread.join()
    doc = seen["failure"]
    assert isinstance(doc, dict)
    assert (doc["attempt"], doc["exitCode"]) == (4, 1)
    assert doc["message"] == "[attempt 4] RuntimeError: nccl"
    assert seen["healthy"] == 200 and seen["after"] == 200
    assert termination.read_text() == ""  # no container end to tell
    assert _runs(tmp_path) == ["4", "5"]


def _zygotes() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children() if "--zygote" in p.cmdline()]


def test_a_warm_supervisor_keeps_one_zygote_for_every_attempt(
    tmp_path: Path, termination: Path
) -> None:
    """Each attempt's trainer is told the zygote's socket; a failed attempt's processes go but
    the zygote stays for the next one; it ends with the supervisor."""
    (tmp_path / "attempt").write_text(order(0, pods=0))
    sockets = tmp_path / "sockets.txt"
    body = ("import psutil\n"
            "z = [p.pid for p in psutil.Process(os.getppid()).children() if '--zygote' in "
            "p.cmdline()]\n"
            "line = f\"{os.environ.get('OMNI_WARM_SOCKET')} {z}\\n\"\n"
            f"open({str(sockets)!r}, 'a').write(line)\n"
            "sys.exit(1 if os.environ['OMNI_RESTART_ATTEMPT'] == '0' else 0)\n")  # fmt: skip
    report = FailureReport(0, "127.0.0.1").start()
    sup = Supervisor(_script(tmp_path, body), attempt_file=tmp_path / "attempt",
                     state_dir=tmp_path / "state", poll_s=0.02, report=report,
                     warm=True)  # fmt: skip
    seen: list[list[int]] = []

    def operator() -> None:
        while report.get() is None:
            time.sleep(0.02)
        seen.append(_zygotes())
        (tmp_path / "attempt").write_text(order(1, pods=0))

    thread = threading.Thread(target=operator)
    thread.start()
    assert sup.run() == 0
    thread.join()
    (first, z0), (second, z1) = (line.split(" ", 1) for line in sockets.read_text().splitlines())
    assert first == second == str(tmp_path / "state" / "warm.sock")
    assert z0 == z1 == str(seen[0]) and len(seen[0]) == 1  # one zygote, kept for attempt 1
    assert _zygotes() == []  # gone with the supervisor


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_newer_attempt_kills_the_running_trainer_and_its_children(
    tmp_path: Path, termination: Path
) -> None:
    pids = tmp_path / "pids"
    body = (f"import subprocess\nif os.environ['OMNI_RESTART_ATTEMPT'] == '0':\n"
            f"    c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"    open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}')\n"
            f"    time.sleep(60)\n")  # fmt: skip
    (tmp_path / "attempt").write_text(order(0, pods=0))
    sup = Supervisor(_script(tmp_path, body), attempt_file=tmp_path / "attempt",
                     state_dir=tmp_path / "state", poll_s=0.02)  # fmt: skip

    def bump() -> None:
        while not pids.exists():
            time.sleep(0.02)
        (tmp_path / "attempt").write_text(order(1, pods=0))

    threading.Thread(target=bump, daemon=True).start()
    assert sup.run() == 0
    assert _runs(tmp_path) == ["0", "1"]
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_restart_in_the_same_pods_tells_the_trainer_its_nodes_are_checked(
    tmp_path: Path, termination: Path
) -> None:
    """The network preflight runs on new nodes only: the first attempt in pods created by
    attempt 1 is on new nodes, the in-place attempt 2 is not."""
    seen = tmp_path / "same.txt"
    body = (f"open({str(seen)!r}, 'a').write(os.environ['OMNI_SAME_NODES'])\n"
            f"if os.environ['OMNI_RESTART_ATTEMPT'] == '1':\n    time.sleep(60)\n")  # fmt: skip
    (tmp_path / "attempt").write_text(order(1, pods=1))
    sup = Supervisor(_script(tmp_path, body), attempt_file=tmp_path / "attempt",
                     state_dir=tmp_path / "state", pods=1, poll_s=0.02)  # fmt: skip

    def bump() -> None:
        while not seen.exists():
            time.sleep(0.02)
        (tmp_path / "attempt").write_text(order(2, pods=1))

    threading.Thread(target=bump, daemon=True).start()
    assert sup.run() == 0
    assert _runs(tmp_path) == ["1", "2"] and seen.read_text() == "01"
