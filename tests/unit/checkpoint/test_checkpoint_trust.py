"""Checkpoints a resume can trust: checksums verified (a same-size corruption falls back to the
step before) and owned (another job's checkpoint is refused, naming the owner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.owner import ForeignCheckpoint, JobIdentity
from omni_trainer.checkpoint.storage import FENCE, S3Storage, step_name
from omni_trainer.checkpoint.verify import mismatches, share
from omni_trainer.components.optim import check_finite

from .test_checkpointer import assert_same, trained

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

JOB = JobIdentity("team-a", "llava", "uid-1")


def _save(ckpt: Checkpointer, *steps: int) -> None:
    for step in steps:
        _, state = trained(steps=step)
        ckpt.save(step, state)
        assert ckpt.wait().committed
    ckpt.close()


def _corrupt_in_place(path: Path) -> None:
    """Flip bytes in the middle of a file: its size (all the old check read) stays."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


def test_a_same_size_corruption_falls_back_to_the_step_before(tmp_path: Path) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"), async_save=False)
    _save(Checkpointer(config, owner=JOB, attempt=0), 2, 4)
    (data,) = (tmp_path / "ck" / step_name(4) / "model").glob("*.distcp")
    size = data.stat().st_size
    _corrupt_in_place(data)
    assert data.stat().st_size == size
    _, fresh = trained(seed=1, steps=1)
    resume = Checkpointer(config, owner=JOB, attempt=1).load_latest(fresh)
    assert resume is not None and resume.step == 2
    assert_same(fresh, trained(steps=2)[1])
    fence = json.loads((tmp_path / "ck" / FENCE).read_text())
    assert fence["resumedFrom"] == 2


def test_a_corrupted_object_on_s3_is_found_streaming(s3_bucket: str, tmp_path: Path) -> None:
    config = CheckpointConfig(
        path=f"s3://{s3_bucket}/run", async_save=False, staging_dir=str(tmp_path / "s")
    )
    ckpt = Checkpointer(config)
    _save(ckpt, 2)
    storage = ckpt.storage
    assert isinstance(storage, S3Storage)
    marker = storage.read_marker(2)
    assert marker is not None
    files = marker["files"]
    assert mismatches(lambda rel: storage.open_file(2, rel), files, sorted(files)) == []
    (rel,) = [r for r in files if r.endswith(".distcp")]
    raw = bytearray(storage.read_bytes(2, rel) or b"")
    raw[0] ^= 0xFF
    storage.write_bytes(2, rel, bytes(raw))
    (bad,) = mismatches(lambda r: storage.open_file(2, r), files, sorted(files), threads=2)
    assert bad.startswith(f"{rel}: sha256 ")
    assert Checkpointer(config).load_latest(trained()[1]) is None  # nothing else to fall back to


def test_the_files_are_shared_among_ranks_by_size() -> None:
    files = {f"f{i}": {"size": size, "sha256": ""} for i, size in enumerate([9, 7, 5, 3, 1])}
    shares = [share(files, rank, 2) for rank in range(2)]
    assert shares == [["f0", "f3", "f4"], ["f1", "f2"]]
    assert sorted(rel for part in shares for rel in part) == sorted(files)


def test_another_jobs_checkpoint_is_refused_naming_the_owner(tmp_path: Path) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"), async_save=False)
    _save(Checkpointer(config, owner=JOB, attempt=0), 2)
    fence = (tmp_path / "ck" / FENCE).read_bytes()
    other = JobIdentity("team-a", "llava-copy", "uid-2")
    with pytest.raises(ForeignCheckpoint) as err:
        Checkpointer(config, owner=other, attempt=3).load_latest(trained()[1])
    message = str(err.value)
    assert "belongs to job team-a/llava (uid uid-1)" in message
    assert f"checkpoint.initFrom: {tmp_path / 'ck'}" in message and "new checkpoint.path" in message
    assert (tmp_path / "ck" / FENCE).read_bytes() == fence  # the owner's attempts not fenced
    # the same job (a later attempt, or deleted and re-applied: a new uid) and a local run resume
    again = JobIdentity("team-a", "llava", "uid-9")
    assert Checkpointer(config, owner=again, attempt=1).load_latest(trained()[1]).step == 2
    assert Checkpointer(config).load_latest(trained()[1]).step == 2


def test_the_owner_comes_from_the_pods_environment() -> None:
    env = {"OMNI_JOB_NAMESPACE": "ns", "OMNI_JOB_NAME": "j", "OMNI_JOB_UID": "u"}
    assert JobIdentity.from_env(env) == JobIdentity("ns", "j", "u")
    assert JobIdentity.from_env({}) is None


def test_a_non_finite_loss_right_after_a_resume_blames_the_checkpoint() -> None:
    with pytest.raises(FloatingPointError, match="checkpoint is the suspect") as err:
        check_finite(62, float("nan"), float("nan"), resumed_from=60)
    assert "step-00000060 aside" in str(err.value) and "learning rate" in str(err.value)
    with pytest.raises(FloatingPointError, match=r"lower optimizer\.lr"):
        check_finite(70, float("nan"), float("nan"), resumed_from=60)
    with pytest.raises(FloatingPointError, match=r"lower optimizer\.lr"):
        check_finite(2, float("nan"), float("inf"))
    check_finite(61, 1.0, 1.0, resumed_from=60)
