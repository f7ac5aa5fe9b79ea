"""How many threads a trainer process computes with."""

from __future__ import annotations

import os

import pytest

from omni_trainer.launch import compute_threads


def test_threads_share_the_cores_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's default: not ours to follow
    assert compute_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert compute_threads() == 1
    monkeypatch.setenv("OMNI_NUM_THREADS", "3")
    assert compute_threads() == 3
    monkeypatch.setenv("OMNI_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="OMNI_NUM_THREADS must be a positive integer"):
        compute_threads()


def test_every_command_hides_megatrons_te_apex_import_warnings() -> None:
    """Importing the CLI (every ``omni`` command) installs the filters before megatron-core
    warns (a process of its own: pytest resets warning filters per test)."""
    import subprocess
    import sys

    megatron_says = (
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "Apex is not installed. Falling back to Torch Norm",
    )
    script = "import warnings, omni_trainer.cli\n" + "".join(
        f"warnings.warn({text!r}, UserWarning)\n" for text in (*megatron_says, "unrelated")
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "unrelated" in done.stderr and "Apex" not in done.stderr


def test_the_launcher_tells_its_workers_the_sources_were_checked_and_keeps_nothing(
    tmp_path, tiny_manifest: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`omni train --nproc 2` checks the sources once and says so to its workers through their
    environment, not its own (a second run in the same process, as under CliRunner, checks
    again)."""
    import yaml
    from typer.testing import CliRunner

    import omni_trainer.launch as launch
    from omni_trainer.cli import app
    from omni_trainer.cli.train import SOURCES_CHECKED

    monkeypatch.delenv(SOURCES_CHECKED, raising=False)
    handed: list[dict] = []

    def start(manifest, *, nproc: int, forwarded: list[str], env=None) -> int:
        handed.append(dict(env or {}))
        return 0

    monkeypatch.setattr(launch, "launch_torchrun", start)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_manifest))
    result = CliRunner().invoke(app, ["train", str(path), "--nproc", "2", "--resume", "none"])
    assert result.exit_code == 0, result.output
    assert handed == [{SOURCES_CHECKED: "1"}]
    assert SOURCES_CHECKED not in os.environ
