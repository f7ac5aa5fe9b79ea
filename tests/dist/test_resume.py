"""Exact resume: a multi-process run killed with SIGKILL continues, with ``--resume auto``, exactly
as if it had never stopped: same loss per step (within 1e-6) and the same samples per step (order-
free fingerprints), none lost and none twice; also when resumed with another layout."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ..conftest import EXAMPLES

pytestmark = pytest.mark.dist

STEPS = 40
INTERVAL = 4


def manifest(tmp_path: Path, name: str, checkpoint_dir: Path) -> Path:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["spec"]["trainer"]["checkpoint"] = {
        "path": str(checkpoint_dir),
        "intervalSteps": INTERVAL,
        "keepLast": 3,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def omni_train(job: Path, *args: str, steps: int = STEPS) -> list[str]:
    cli = [sys.executable, "-m", "omni_trainer.cli", "train", str(job)]
    return [*cli, "--steps", str(steps), *args]


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def kill_a_worker_after(
    popen: subprocess.Popen,
    job: Path,
    committed: Path,
    timeout: float = 300,
    sig: signal.Signals = signal.SIGKILL,
) -> None:
    """Signal one torchrun worker of ``job``'s run (SIGKILL: a crash) as soon as ``committed``
    exists. Its workers are the stand-ins torchrun started (``omni_trainer.warm``: a zygote's
    forked trainer dies with its stand-in; without a zygote the stand-in is the trainer)."""
    deadline = time.monotonic() + timeout
    while not committed.exists():
        assert popen.poll() is None, "the run ended before its checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    workers = [p for p in psutil.process_iter() if _is_worker(p, job)]
    assert len(workers) == 2, workers
    workers[-1].send_signal(sig)


def _is_worker(process: psutil.Process, job: Path) -> bool:
    """A process torchrun started for ``job`` (its start environment has torchrun's LOCAL_RANK;
    a forked trainer's shows its zygote's)."""
    try:
        return str(job) in process.cmdline() and "LOCAL_RANK" in process.environ()
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run's summary (one process), shared by the interrupted runs here."""
    tmp_path = tmp_path_factory.mktemp("reference")
    reference = tmp_path / "reference.json"
    run(
        [*omni_train(manifest(tmp_path, "ref", tmp_path / "ckpt-ref")), "--summary", str(reference)]
    )
    return json.loads(reference.read_text())


def test_killed_run_resumes_exactly(tmp_path: Path, ref: dict) -> None:

    ckpt = tmp_path / "ckpt"
    job = manifest(tmp_path, "job", ckpt)
    killed = subprocess.Popen(
        [*omni_train(job, "--nproc", "2")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_a_worker_after(killed, job, ckpt / "step-00000008" / "COMMITTED")
    assert killed.wait(timeout=120) != 0, "the run was not interrupted"
    other_layout = tmp_path / "ckpt-copy"
    shutil.copytree(ckpt, other_layout)

    resumed = tmp_path / "resumed.json"
    run([*omni_train(job, "--nproc", "2", "--resume", "auto"), "--summary", str(resumed)])
    moved = tmp_path / "moved.json"
    run(
        [
            *omni_train(manifest(tmp_path, "moved", other_layout), "--resume", "auto"),
            "--summary",
            str(moved),
        ]
    )

    for path, world in ((resumed, 2), (moved, 1)):
        got = json.loads(path.read_text())
        start = got["first_step"]
        assert start >= 8 and start % INTERVAL == 0 and got["world_size"] == world
        assert got["loss_curve"] == pytest.approx(ref["loss_curve"][start:], abs=1e-6)
        assert got["batch_fingerprints"] == ref["batch_fingerprints"][start:]
        assert start + got["steps"] == STEPS


def test_resume_without_checkpoint_starts_fresh(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    job = manifest(tmp_path, "fresh", tmp_path / "empty")
    run(omni_train(job, "--resume", "auto", "--summary", str(out), steps=2))
    assert json.loads(out.read_text())["first_step"] == 0


def test_sigterm_stops_every_rank_with_an_emergency_checkpoint(tmp_path: Path, ref: dict) -> None:
    """SIGTERM to ONE worker (the other is not signalled): both stop after the same step, the
    checkpoint of that step is written although it is not due, the run exits with the graceful
    stop's code, and the resumed run recomputes no step and matches an uninterrupted run."""
    from omni_trainer.checkpoint.storage import FilesystemStorage
    from omni_trainer.components.graceful_stop import EXIT_STOPPED

    ckpt = tmp_path / "ckpt"
    job = manifest(tmp_path, "job", ckpt)
    stopped_summary = tmp_path / "stopped.json"
    stopped = subprocess.Popen(
        [*omni_train(job, "--nproc", "2", "--summary", str(stopped_summary))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    kill_a_worker_after(stopped, job, ckpt / "step-00000004" / "COMMITTED", sig=signal.SIGTERM)
    out, _ = stopped.communicate(timeout=120)
    assert stopped.returncode != 0 and f"exitcode  : {EXIT_STOPPED}" in out, out[-3000:]
    assert "on SIGTERM" in out, out[-3000:]
    done = json.loads(stopped_summary.read_text())["steps"]
    assert 4 <= done < STEPS
    assert FilesystemStorage(ckpt).latest_complete() == done  # nothing to recompute

    resumed = tmp_path / "resumed.json"
    run([*omni_train(job, "--nproc", "2", "--resume", "auto"), "--summary", str(resumed)])
    got = json.loads(resumed.read_text())
    assert got["first_step"] == done
    assert got["loss_curve"] == pytest.approx(ref["loss_curve"][done:], abs=1e-6)
    assert got["batch_fingerprints"] == ref["batch_fingerprints"][done:]
