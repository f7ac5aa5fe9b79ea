"""A job whose LLM is `model.llm.hf` on the pods' storage (a PVC path, or S3 with the job's own
credentials): the operator, `omni render` and `omni validate` cannot read that model, so they
accept the job without its dimensions and leave the checks that need them to where the job runs
(`omni validate --sources`, `omni train` in every pod). They never touch the storage."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import omni_trainer.interop.source as hf_source
from omni_operator.render import render_config_map
from omni_operator.sandbox.testbed import job_manifest
from omni_operator.spec import parse_job
from omni_trainer.cli import app
from omni_trainer.config import ManifestError

from ..interop.hf_models import save_llm


def _hf_job(hf: str, **llm: object) -> dict:
    doc = job_manifest("hf-job")
    doc["spec"]["trainer"]["model"]["llm"] = {"hf": hf, **llm}
    return doc


@pytest.fixture
def storage_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    def read_config(path: str) -> dict:
        raise AssertionError(f"read {path} where the pods' storage is out of reach")

    monkeypatch.setattr(hf_source, "read_config", read_config)


@pytest.mark.parametrize("hf", ["/models/llama-3-8b", "s3://bucket/llama-3-8b"])
def test_the_operator_accepts_a_model_it_cannot_read(hf: str, storage_untouched: None) -> None:
    job = parse_job(_hf_job(hf))
    llm = job.spec.trainer.model.llm
    assert llm.hf == hf and not llm.resolved
    rendered = yaml.safe_load(next(iter(render_config_map(job)["data"].values())))
    # The pods get the manifest as written: nothing the operator could not know is filled in.
    assert rendered["spec"]["trainer"]["model"]["llm"] == {"hf": hf}


def test_fields_beside_hf_are_still_refused_without_reading_it(storage_untouched: None) -> None:
    with pytest.raises(ManifestError, match="numLayers cannot be set beside 'hf'"):
        parse_job(_hf_job("/models/llama", numLayers=4))


def test_validate_defers_the_model_and_sources_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_hf_job(str(tmp_path / "absent"))))
    runner = CliRunner()
    deferred = runner.invoke(app, ["validate", str(path)])
    assert deferred.exit_code == 0, deferred.output
    assert "was not read: the checks that need its dimensions run with --sources" in (
        deferred.stderr
    )
    opened = runner.invoke(app, ["validate", str(path), "--sources"])
    assert opened.exit_code == 2
    assert "spec.trainer.model.llm: hf: " in opened.stderr and "no config.json" in opened.stderr


def test_a_readable_model_is_checked_in_full(tmp_path: Path) -> None:
    """Where the model is readable (`--sources`), its KV heads meet the layout checks."""
    doc = _hf_job(str(save_llm(tmp_path / "m", "llama", num_key_value_heads=1)))
    doc["spec"]["trainer"]["parallelism"] = {"tensor": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert CliRunner().invoke(app, ["validate", str(path)]).exit_code == 0  # deferred
    result = CliRunner().invoke(app, ["validate", str(path), "--sources"])
    assert result.exit_code == 2
    assert "spec.trainer.model.llm.numQueryGroups: numQueryGroups (1) must be a multiple" in (
        result.stderr
    ), result.stderr


def test_imported_encoders_are_deferred_alike(storage_untouched: None) -> None:
    doc = job_manifest("hf-job")
    encoders = {"image": {"hf": "s3://bucket/clip", "featureLayer": -1}, "audio": {"hf": "/w"}}
    doc["spec"]["trainer"]["model"]["encoders"] = encoders
    job = parse_job(doc)
    assert [m for m, e in job.spec.trainer.model.unread_hf()] == [
        "encoders.image",
        "encoders.audio",
    ]
    rendered = yaml.safe_load(next(iter(render_config_map(job)["data"].values())))
    assert rendered["spec"]["trainer"]["model"]["encoders"] == encoders
    doc["spec"]["trainer"]["model"]["encoders"]["image"]["numHeads"] = 4
    with pytest.raises(ManifestError, match="image: numHeads cannot be set beside 'hf'"):
        parse_job(doc)
