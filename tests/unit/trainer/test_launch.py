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
