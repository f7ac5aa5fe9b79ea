"""``omni train`` end to end in real processes: torchrun workers (gloo) equal a single process.

Through the CLI, data, tensor and pipeline parallel runs give the same training as one process on
the same global batch: loss and gradient norm of every step within 1e-5. (Every layout x policy
with full gradients: test_multiplex_equivalence.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..conftest import EXAMPLES

pytestmark = pytest.mark.dist

STEPS = 4
TOLERANCE = 1e-5  # absolute on the loss (~6), relative on the grad norm; fp32 reduction order


def omni(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_trainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train(manifest: Path, nproc: int, out: Path) -> dict:
    proc = omni(
        "train", str(manifest), "--steps", str(STEPS), "--nproc", str(nproc), "--summary", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return train(EXAMPLES / "tiny-cpu.yaml", 1, tmp_path_factory.mktemp("single") / "s.json")


@pytest.mark.parametrize(
    ("tensor", "pipeline", "nproc", "layout"),
    [(1, 1, 2, "dp2"), (2, 1, 2, "tp2"), (2, 1, 4, "tp2xdp2"), (1, 2, 4, "pp2xdp2")],
)
def test_parallel_run_equals_single_process(
    single, tmp_path, tensor, pipeline, nproc, layout
) -> None:
    """The CLI path: ``--nproc N`` with a parallel layout equals ``--nproc 1``."""
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["spec"]["trainer"]["parallelism"] = {"tensor": tensor, "pipeline": pipeline}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    result = train(manifest, nproc, tmp_path / "s.json")
    assert result["world_size"] == nproc and result["layout"]["name"] == layout
    assert result["loss_curve"] == pytest.approx(single["loss_curve"], abs=TOLERANCE)
    assert result["grad_norm_curve"] == pytest.approx(single["grad_norm_curve"], rel=TOLERANCE)
    assert result["samples_per_modality"] == single["samples_per_modality"]
    assert result["parameters"] == single["parameters"]


def test_cli_reports_bad_manifest_with_field_path(tmp_path) -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["spec"]["trainer"]["data"]["seqLenght"] = 128
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    for command in ("validate", "train"):
        proc = omni(command, str(bad))
        assert proc.returncode == 2
        assert "spec.trainer.data.seqLenght: unknown field" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_cli_rejects_layout_that_does_not_divide_world(tmp_path) -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["spec"]["trainer"]["parallelism"] = {"tensor": 2}
    manifest = tmp_path / "tp2.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    proc = omni("train", str(manifest), "--steps", "1")
    assert proc.returncode == 2
    assert "spec.trainer.parallelism: world size 1 is not a multiple" in proc.stderr


def test_cli_rejects_batch_sizes_that_do_not_fit_nproc_once() -> None:
    """tiny-cpu's batch (8 sequences, micro-batches of 4) cannot split over 4 data-parallel
    ranks: one message naming the field and the fix, before torchrun starts any worker."""
    proc = omni("train", str(EXAMPLES / "tiny-cpu.yaml"), "--nproc", "4", "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.count("spec.trainer.data.globalBatchSize: globalBatchSize (8) must be") == 1
    assert "change the batch sizes or the number of processes" in proc.stderr
    assert "(world size 4 = --nproc)" in proc.stderr
    for worker_trace in ("Traceback", "[rank", "ChildFailedError", "torch.distributed"):
        assert worker_trace not in proc.stdout + proc.stderr


def test_plan_prints_the_dataflow_table(tmp_path) -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["spec"]["trainer"]["model"]["llm"]["numLayers"] = 4
    doc["spec"]["trainer"]["data"]["microBatchSize"] = 1
    doc["spec"]["trainer"]["parallelism"] = {"pipeline": 2, "encoder": {"eta": 16}}
    manifest = tmp_path / "pp2.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    proc = omni("plan", str(manifest), "--world", "4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "layout pp2xdp2 (world 4)" in out
    assert "dataflow table (auto): pp=2 vpp=1 micro-batches=4" in out
    assert "stage 0" in out and "stage 1" in out and "E0" in out
    assert "paper notation" in out
    bad = omni("plan", str(manifest), "--world", "3")
    assert bad.returncode == 2 and "world size 3 is not a multiple" in bad.stderr


def test_plan_tune_recommends_fitting_configurations() -> None:
    proc = omni(
        "plan", str(EXAMPLES / "paper-workload-a.yaml"), "--tune", "--gpus", "64", timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "paper-a on 64 x H100" in proc.stdout
    # rank 1, or 1= when the next prediction is within the tie margin
    assert re.search(r"^1=?\. #1 of", proc.stdout, re.M) and "GiB" in proc.stdout
    assert "device: H100" in proc.stdout and "default; the manifest names no GPU" in proc.stdout
    assert "own: the manifest's layout (tp4 pp2 vpp1 dp8" in proc.stdout  # beside the best
    assert "switching to #1 gains" in proc.stdout
