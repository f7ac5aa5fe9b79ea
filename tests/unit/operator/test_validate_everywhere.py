"""One validation, everywhere: `omni validate`, `omni render` and `omni train` reject the bad jobs
of tests/jobs.py with the very lines the operator writes into the job's status (its test:
tests/operator/test_operator.py), before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from omni_operator.sandbox.testbed import job_manifest
from omni_operator.spec import parse_job
from omni_trainer.cli import app
from omni_trainer.config import ManifestError

from ...jobs import INVALID, invalid_job

NODES = Path(__file__).parent / "data" / "nodes-16.yaml"
LOCAL = {"unknown", "nodes", "budget", "micro", "typo", "kvheads", "layers", "batch", "seqlen"}
"""Mistakes that also stop a local run (the others are about placement on the cluster)."""


def _write(tmp_path: Path, name: str) -> tuple[Path, str]:
    """The bad job as a file, and the operator's verdict on it (status.message's lines)."""
    changes, _ = INVALID[name]
    doc = invalid_job(job_manifest(name), changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError) as info:
        parse_job(doc)
    return path, str(info.value)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_validate_and_render_reject_what_the_operator_rejects(tmp_path: Path, name: str) -> None:
    path, verdict = _write(tmp_path, name)
    field = INVALID[name][1]
    assert field in verdict
    runner = CliRunner()
    for args in (["validate", str(path)], ["render", str(path), "--nodes", str(NODES)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert f"{path}: invalid OmniTrainingJob\n{verdict}\n" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not result.stdout


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`omni train` must stop before torchrun or a worker starts."""
    import omni_trainer.launch as launch

    def started(*_, **__) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(launch, "launch_torchrun", started)
    monkeypatch.setattr(launch, "run_worker", started)


@pytest.mark.parametrize("name", sorted(LOCAL))
def test_train_rejects_once_before_torchrun(tmp_path: Path, name: str, no_launch: None) -> None:
    path, _ = _write(tmp_path, name)
    result = CliRunner().invoke(app, ["train", str(path), "--nproc", "4"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("invalid OmniTrainingJob") == 1
    assert INVALID[name][1] in result.stderr and "Traceback" not in result.stderr


def test_train_checks_the_layout_at_nproc(tmp_path: Path, no_launch: None) -> None:
    """A local run is checked at --nproc (not at the cluster fields), once, naming the fix."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_manifest()))  # 4 data-parallel ranks fit globalBatchSize 8
    result = CliRunner().invoke(app, ["train", str(path), "--nproc", "3"])
    assert result.exit_code == 2
    assert "spec.trainer.data.globalBatchSize: globalBatchSize (8) must be a multiple of " in (
        result.stderr
    )
    assert "(2 x 3 = 6)" in result.stderr and "(world size 3 = --nproc)" in result.stderr
    ok = CliRunner().invoke(app, ["validate", str(path), "--nproc", "2"])
    assert ok.exit_code == 0 and "valid OmniTrainingJob 'train' on --nproc 2" in ok.stdout


def test_every_problem_at_once(tmp_path: Path) -> None:
    semantic = job_manifest()
    for name in ("kvheads", "layers"):
        semantic = invalid_job(semantic, INVALID[name][0])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(invalid_job(semantic, {"maxRuntime": 1, "nodes": 0})))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert "spec.maxRuntime: unknown field" in result.stderr
    assert "spec.nodes: Input should be greater than or equal to 1" in result.stderr
    path.write_text(yaml.safe_dump(semantic))  # the semantic ones, once the fields are right
    result = CliRunner().invoke(app, ["validate", str(path)])
    lines = [x for x in result.stderr.splitlines() if x.startswith("spec.")]
    assert [x.split(":")[0] for x in lines] == [
        "spec.trainer.model.llm.numQueryGroups",
        "spec.trainer.model.llm.numLayers",
    ]


def test_seq_length_that_cuts_samples_is_a_warning_with_figures(tmp_path: Path) -> None:
    doc = job_manifest()
    doc["spec"]["trainer"]["data"]["seqLength"] = 64
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    warnings = [x for x in result.stderr.splitlines() if x.startswith("warning:")]
    assert any("'openimages' samples are longer than data.seqLength (64" in w for w in warnings)
    trainer = [w for w in warnings if w.startswith("warning: spec.trainer.")]
    assert trainer and all("samples per step" in w for w in trainer), warnings


def test_multi_node_gpu_job_without_rdma_is_warned_of_tcp_everywhere(
    tmp_path: Path, no_launch: None
) -> None:
    """validate, render and train say that NCCL will use TCP between nodes, naming the field;
    resources.rdma, or NCCL_IB_DISABLE chosen in nccl.env, silence it."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_manifest()))  # 2 nodes x 2 GPUs, no resources.rdma
    runner = CliRunner()
    for args in (
        ["validate", str(path)],
        ["render", str(path), "--nodes", str(NODES)],
        ["train", str(path), "--nproc", "2", "--steps", "1"],
    ):
        result = runner.invoke(app, args)
        tcp = [x for x in result.stderr.splitlines() if "spec.resources.rdma: " in x]
        assert len(tcp) == 1 and tcp[0].startswith("warning: "), (args, result.stderr)
        assert "NCCL_IB_DISABLE=1" in tcp[0] and "TCP" in tcp[0]
        if args[0] != "train":  # train stops at the monkeypatched launch
            assert result.exit_code == 0, result.output
    for spec in (
        {"resources": {"rdma": {"count": 1}}},
        {"nccl": {"env": {"NCCL_IB_DISABLE": "1"}}},
    ):
        path.write_text(yaml.safe_dump(job_manifest(**spec)))
        result = runner.invoke(app, ["validate", str(path)])
        assert result.exit_code == 0 and "spec.resources.rdma" not in result.stderr, spec
