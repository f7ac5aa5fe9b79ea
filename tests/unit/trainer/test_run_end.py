"""The end of a run: its last step is saved whatever ``intervalSteps`` is, and a fresh local run
does not overwrite an earlier run's checkpoints."""

from __future__ import annotations

import copy

import yaml
from typer.testing import CliRunner

from omni_trainer.checkpoint.earlier_run import earlier_run
from omni_trainer.checkpoint.storage import FilesystemStorage
from omni_trainer.cli import app
from omni_trainer.config import parse_manifest
from omni_trainer.trainer import Trainer


def test_last_step_is_saved_and_a_fresh_run_does_not_overwrite_it(
    tiny_manifest, single_rank, tmp_path
) -> None:
    doc = copy.deepcopy(tiny_manifest)
    ckpt = tmp_path / "ckpt"
    doc["spec"]["trainer"]["checkpoint"] = {"path": str(ckpt), "intervalSteps": 2}  # async
    cfg = parse_manifest(doc).spec.trainer
    assert earlier_run(cfg.checkpoint) is None
    Trainer(cfg, groups=single_rank, steps=3).train()
    storage = FilesystemStorage(ckpt)
    assert storage.list_steps() == [2, 3] and storage.latest_complete() == 3

    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    refused = CliRunner().invoke(app, ["train", str(manifest)], env={"OMNI_RESUME": None})
    assert refused.exit_code == 2, refused.output
    assert "holds an earlier run's checkpoints (step-00000002, step-00000003)" in refused.output
    assert "--resume auto" in refused.output
    assert storage.list_steps() == [2, 3]
