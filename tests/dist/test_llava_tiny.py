"""examples/llava-tiny.yaml end to end: real PNG/JPEG/WAV conversations with 2 corrupt and 1
missing media file planted; two processes train a clearly falling loss, the summary counts the
3 skips by reason, and a SIGKILL + ``--resume auto`` continues the uninterrupted run's curve
exactly (one process against two is test_llm_core's and test_multiplex_equivalence's: over 50
steps at this learning rate their fp32 reduction orders drift apart by more than 1e-5)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from omni_trainer.components.progress import read_step_log
from omni_trainer.data.tinyset import make_tiny_dataset

from ..conftest import EXAMPLES
from .test_resume import kill_a_worker_after, omni_train, run

pytestmark = pytest.mark.dist

STEPS = 50
INTERVAL = 8
SKIPS = {"corrupt": 2, "missing": 1}


def manifest(tmp_path: Path, data: Path, name: str, **trainer) -> Path:
    doc = yaml.safe_load((EXAMPLES / "llava-tiny.yaml").read_text())
    spec = doc["spec"]["trainer"]
    spec["tokenizer"] = str(data / "tokenizer")
    spec["data"]["sources"][0]["url"] = str(data / "train.json")
    spec.update(trainer)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_llava_tiny_trains_through_bad_files_and_resumes_exactly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # enough records that 50 steps stay inside one epoch: every bad file is drawn exactly once
    make_tiny_dataset(str(data), images=480, audio=96, corrupt=[3, 10], missing=[17])

    reference = tmp_path / "reference.json"
    run([*omni_train(manifest(tmp_path, data, "reference"), "--nproc", "2", steps=STEPS),
         "--summary", str(reference)])  # fmt: skip
    ref = json.loads(reference.read_text())
    assert ref["skipped_samples"] == SKIPS
    losses = ref["loss_curve"]
    assert sum(losses[-5:]) / 5 < 0.3 * losses[0], losses

    ckpt, steps_log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    two = manifest(
        tmp_path,
        data,
        "two",
        checkpoint={"path": str(ckpt), "intervalSteps": INTERVAL, "keepLast": 2},
        train={"steps": STEPS, "stepLog": str(steps_log)},
    )
    killed = subprocess.Popen(
        omni_train(two, "--nproc", "2", steps=STEPS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_a_worker_after(killed, two, ckpt / f"step-{2 * INTERVAL:08d}" / "COMMITTED")
    assert killed.wait(timeout=120) != 0, "the run was not interrupted"
    resumed = tmp_path / "resumed.json"
    run([*omni_train(two, "--nproc", "2", "--resume", "auto", steps=STEPS),
         "--summary", str(resumed)])  # fmt: skip
    got = json.loads(resumed.read_text())

    start = got["first_step"]
    assert start >= 2 * INTERVAL and start + got["steps"] == STEPS and got["world_size"] == 2
    assert got["batch_fingerprints"] == ref["batch_fingerprints"][start:]
    assert got["loss_curve"] == pytest.approx(losses[start:], abs=1e-5)
    assert got["skipped_samples"] == SKIPS  # restored with the loader state, not counted twice
    two_procs = read_step_log(steps_log)  # every step, the killed attempt's included
    assert list(two_procs) == list(range(1, STEPS + 1))
    assert list(two_procs.values()) == pytest.approx(losses, abs=1e-5)
