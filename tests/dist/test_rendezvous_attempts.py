"""Real torchrun agents: an in-place restart's rendezvous never completes on the store of the
attempt before (what ``omni_trainer.supervisor.for_target``'s ``--rdzv-id`` is for).

Node rank 0's torchrun hosts the static rendezvous store. When the order for attempt N+1
reaches node rank 1 before rank 0's supervisor has killed its attempt-N torchrun, rank 1's new
torchrun connects to that old store. Keyed like the old attempt, it completes its rendezvous on
the old attempt's keys at once and starts a worker that waits for a rank 0 which rendezvouses
in the new store: a deadlock. Keyed per attempt, it waits there and fails when the old store
goes (the operator restarts again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from omni_trainer.pod_protocol import rdzv_id

from .harness import free_port

WORKER = "import os, time; print('worker up', flush=True); time.sleep(120)\n"


def _torchrun(tmp: Path, rank: int, attempt: int, port: int, name: str) -> subprocess.Popen:
    log = (tmp / f"{name}.log").open("w")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
            "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
            f"--rdzv-id={rdzv_id(attempt)}", "--max-restarts=0",
            str(tmp / "worker.py")]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _kill(proc: subprocess.Popen) -> None:
    """The agent and its worker (a supervisor kills every process below it)."""
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def _up(tmp: Path, name: str) -> bool:
    return "worker up" in (tmp / f"{name}.log").read_text()


def _in_store(root: int, port: int, attempt: int) -> bool:
    """Whether a torchrun of ``attempt`` below ``root`` holds a connection to the store on
    ``port``: it reached its rendezvous (under load, its imports alone can take seconds)."""
    flag = f"--rdzv-id={rdzv_id(attempt)}"
    tree = psutil.Process(root)
    for proc in [tree, *tree.children(recursive=True)]:
        try:
            if flag not in proc.cmdline():
                continue
            for conn in proc.net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == port and conn.status == "ESTABLISHED":
                    return True
        except psutil.NoSuchProcess:
            continue
    return False


def _wait(what: str, check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_restarted_rank_never_rendezvouses_on_the_previous_attempts_store(
    tmp_path: Path,
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    old0 = _torchrun(tmp_path, 0, 0, port, "old0")
    old1 = _torchrun(tmp_path, 1, 0, port, "old1")
    procs = [old0, old1]
    try:
        _wait("attempt 0's workers", lambda: _up(tmp_path, "old0") and _up(tmp_path, "old1"))
        _kill(old1)
        # Control: keyed like attempt 0, rank 1's new torchrun completes on the stale keys.
        stale = _torchrun(tmp_path, 1, 0, port, "stale")
        procs.append(stale)
        t0 = time.monotonic()
        _wait("a worker on the stale keys", lambda: _up(tmp_path, "stale"))
        control_s = time.monotonic() - t0
        _kill(stale)
        # Keyed per attempt: it waits in the old store, never starting a worker...
        new1 = _torchrun(tmp_path, 1, 1, port, "new1")
        procs.append(new1)
        _wait("rank 1's new torchrun in the old store", lambda: _in_store(new1.pid, port, 1))
        time.sleep(max(5.0, 4 * control_s))  # the control's worker started in a quarter
        assert new1.poll() is None and not _up(tmp_path, "new1")
        # ...and fails once rank 0's supervisor kills the old attempt's torchrun.
        _kill(old0)
        assert new1.wait(timeout=60) != 0 and not _up(tmp_path, "new1")
        assert "DistNetworkError" in (tmp_path / "new1.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)


def test_a_supervisor_starts_its_attempt_again_when_the_old_store_closes_under_it(
    tmp_path: Path,
) -> None:
    """What the deadlock fix leaves: rank 1's new torchrun waits in rank 0's old store and fails
    when rank 0 restarts. Its supervisor sees the failure was the agent's rendezvous (no worker
    ran) and starts the same attempt again, which meets rank 0's new torchrun: no failure
    reaches the operator (it restarted the whole job once more, and counted it against node 1)."""
    from omni_trainer.pod_protocol import order

    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    attempt = tmp_path / "attempt"
    attempt.write_text(order(0, pods=0))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1",
            "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
            f"--rdzv-id={rdzv_id(0)}", "--max-restarts=0", str(tmp_path / "worker.py")]  # fmt: skip
    sup1_log = tmp_path / "sup1.log"
    log = sup1_log.open("w")
    sup1 = subprocess.Popen(
        [sys.executable, "-m", "omni_trainer.cli", "supervise", f"--attempt-file={attempt}",
         f"--state-dir={tmp_path / 'state'}", "--", *argv],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMNI_RESTART_ATTEMPT": "0"},
    )  # fmt: skip
    old0 = _torchrun(tmp_path, 0, 0, port, "old0")
    procs = [sup1, old0]
    try:
        _wait("attempt 0's workers",
              lambda: _up(tmp_path, "old0") and _up(tmp_path, "sup1"))  # fmt: skip
        attempt.write_text(order(1, pods=0))  # rank 1 hears of attempt 1 first
        _wait("rank 1's attempt 1 started",
              lambda: "starting attempt 1" in sup1_log.read_text())  # fmt: skip
        # its new torchrun waits in rank 0's old store
        _wait("rank 1's new torchrun in the old store", lambda: _in_store(sup1.pid, port, 1))
        _kill(old0)  # rank 0's supervisor restarts: the old store closes
        _wait("rank 1's retry", lambda: "failed in its rendezvous" in sup1_log.read_text())
        new0 = _torchrun(tmp_path, 0, 1, port, "new0")
        procs.append(new0)

        def both_up() -> bool:
            return _up(tmp_path, "new0") and sup1_log.read_text().count("worker up") == 2

        _wait("attempt 1's workers", both_up)
        assert sup1.poll() is None  # the failure never left the pod
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
