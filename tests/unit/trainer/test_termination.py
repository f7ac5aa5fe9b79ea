"""The trainer's fatal error in the termination message: one line, the first rank's, bounded;
`omni train` writes it for a bad manifest and for unreachable sources before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app
from omni_trainer.termination import LIMIT_BYTES, FinalReport, fatal_message, final_report, report


@pytest.fixture
def term_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    path.write_bytes(b"")
    monkeypatch.setenv("OMNI_TERMINATION_LOG", str(path))
    return path


def test_first_error_wins_and_names_rank_and_type(
    term_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    report(fatal_message(FileNotFoundError("no shard at /data/x")))
    report(fatal_message(RuntimeError("peer closed the connection")))  # a consequence
    assert term_log.read_text() == "rank 3: FileNotFoundError: no shard at /data/x"
    assert len(fatal_message(ValueError("x" * 10_000)).encode()) <= LIMIT_BYTES


def test_no_termination_log_outside_a_container(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_TERMINATION_LOG", raising=False)
    report("nothing to write to")  # /dev/termination-log does not exist here: no error


def test_train_reports_unreachable_sources_before_starting(
    term_log: Path, tmp_path: Path, tiny_manifest: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    trainer = tiny_manifest["spec"]["trainer"]
    trainer["data"]["sources"][0] = {
        "kind": "shards",
        "name": "web",
        "modality": "image",
        "url": str(tmp_path / "missing" / "*.tar"),
    }
    trainer["checkpoint"] = {"path": "s3://no-such-bucket/ckpt", "intervalSteps": 5}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_manifest))

    checked = CliRunner().invoke(app, ["validate", str(path), "--sources"])
    assert checked.exit_code == 2
    url_line = f"spec.trainer.data.sources[0].url ({tmp_path}/missing/*.tar): FileNotFoundError"
    assert url_line in checked.stderr
    assert "spec.trainer.checkpoint.path (s3://no-such-bucket/ckpt): NoCredentialsError" in (
        checked.stderr
    )
    assert CliRunner().invoke(app, ["validate", str(path)]).exit_code == 0  # not without --sources

    result = CliRunner().invoke(app, ["train", str(path), "--steps", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    message = term_log.read_text()
    assert url_line in message and "Unable to locate credentials" in message


def test_final_report_holds_the_final_figures() -> None:
    summary = {"first_step": 40, "steps": 110, "tokens_per_second": 5201.4, "mfu": 0.111}
    assert json.loads(final_report({**summary, "last_checkpoint_step": 150})) == {
        "step": 150, "tokensPerSecond": 5201.4, "mfu": 0.111, "resumedFrom": 40,
        "checkpointStep": 150,
    }  # fmt: skip
    assert "checkpointStep" not in json.loads(final_report({**summary, "first_step": 0}))


def test_a_run_with_nothing_left_to_train_still_reports_where_it_resumed() -> None:
    """Resumed at its last step (killed after it): the operator confirms the restart from this."""
    done = final_report({"first_step": 100, "steps": 0, "last_checkpoint_step": 100})
    assert json.loads(done) == {"step": 100, "resumedFrom": 100, "checkpointStep": 100}


def test_final_report_carries_the_preflight_unless_it_would_not_fit() -> None:
    small = {"nodes": {"n0": 1.5}, "seconds": 0.2}
    done = {"first_step": 0, "steps": 5}
    assert json.loads(final_report({**done, "preflight": small}))["preflight"] == small
    large = {"nodes": {f"node-{i:04d}": 1.5 for i in range(400)}}
    text = final_report({**done, "preflight": large})
    assert len(text.encode()) <= LIMIT_BYTES and json.loads(text) == {"step": 5, "resumedFrom": 0}


def test_the_operator_reads_back_what_the_trainer_wrote() -> None:
    """One contract: :meth:`FinalReport.parse` (the operator's side) of :func:`final_report`."""
    summary = {"first_step": 40, "steps": 110, "tokens_per_second": 5201.4, "mfu": 0.111,
               "last_checkpoint_step": 150, "step_time_curve": [3.0], "wall_time_s": 10.5,
               "preflight": {"nodes": {"n0": 1.5}}}  # fmt: skip
    assert FinalReport.parse(final_report(summary)) == FinalReport(
        since_first_step_s=7.5, step=150, tokens_per_second=5201.4, mfu=0.111, resumed_from=40,
        checkpoint_step=150, preflight={"nodes": {"n0": 1.5}},
    )  # fmt: skip
    assert FinalReport.parse("rank 1: RuntimeError: boom") is None
    assert FinalReport.parse('{"step": "7", "mfu": true}') == FinalReport()  # wrong types: unknown
