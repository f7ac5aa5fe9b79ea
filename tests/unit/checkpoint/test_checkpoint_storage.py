"""Commit marker, discovery, retention and corrupt-skip, on a directory and on real S3 (moto)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from omni_trainer.checkpoint.storage import (
    CheckpointStorage,
    FilesystemStorage,
    S3Storage,
    describe_file,
    step_name,
)


@pytest.fixture(params=["fs", "s3"])
def storage(request, tmp_path: Path) -> CheckpointStorage:
    if request.param == "fs":
        return FilesystemStorage(tmp_path / "ckpt")
    bucket = request.getfixturevalue("s3_bucket")
    return S3Storage(f"s3://{bucket}/jobs/a")


def put_step(storage: CheckpointStorage, step: int, tmp: Path, *, commit: bool = True) -> None:
    """A checkpoint of two files, committed (marker last) or left partial."""
    files = {}
    for rel, size in (("model/__0_0.distcp", 3000), ("loader/rank-00000.json", 20)):
        local = tmp / f"{step}-{rel.replace('/', '_')}"
        local.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        storage.upload(step, rel, local)
        files[rel] = describe_file(local)
    if commit:
        storage.commit(step, files, layout={"tp": 2})


def test_marker_is_what_makes_a_step_count(storage, tmp_path: Path) -> None:
    put_step(storage, 10, tmp_path)
    put_step(storage, 20, tmp_path, commit=False)
    assert storage.list_steps() == [10, 20]
    assert storage.latest_complete() == 10
    marker = storage.read_marker(10)
    assert marker["step"] == 10 and marker["layout"] == {"tp": 2}
    assert marker["files"]["model/__0_0.distcp"]["size"] == 3000
    assert len(marker["files"]["model/__0_0.distcp"]["sha256"]) == 64


def test_corrupt_newest_is_skipped_with_a_warning(storage, tmp_path: Path, caplog) -> None:
    put_step(storage, 1, tmp_path)
    put_step(storage, 2, tmp_path)
    put_step(storage, 3, tmp_path)
    storage.write_bytes(3, "model/__0_0.distcp", b"truncated")  # size no longer matches
    storage.write_bytes(2, "COMMITTED", b"{not json")  # unreadable marker
    with caplog.at_level(logging.WARNING):
        assert storage.latest_complete() == 1
    assert "step-00000003" in caplog.text and "bytes" in caplog.text
    assert "step-00000002" in caplog.text


def test_missing_file_makes_a_step_incomplete(storage, tmp_path: Path) -> None:
    put_step(storage, 5, tmp_path)
    assert storage.problem(5) is None
    if isinstance(storage, FilesystemStorage):
        (storage.root / step_name(5) / "loader" / "rank-00000.json").unlink()
    else:
        storage.client.delete_object(
            Bucket=storage.bucket, Key=storage._key(5, "loader/rank-00000.json")
        )
    assert "missing" in storage.problem(5)
    assert storage.latest_complete() is None


def test_retention_keeps_last_k_and_in_flight_partials(storage, tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        put_step(storage, step, tmp_path)
    put_step(storage, 0, tmp_path, commit=False)  # stale partial: older than newest complete
    put_step(storage, 9, tmp_path, commit=False)  # newer partial: may still be in flight
    deleted = storage.retain(keep_last=2)
    assert sorted(deleted) == [0, 1, 2]
    assert storage.list_steps() == [3, 4, 9]
    assert storage.latest_complete() == 4


def test_fetch_verifies_hashes(storage, tmp_path: Path) -> None:
    put_step(storage, 7, tmp_path)
    root = storage.fetch(7, tmp_path / "dl", prefix="model/", verify=True)
    assert (root / "model" / "__0_0.distcp").stat().st_size == 3000


def test_s3_url_parsing(s3_bucket: str) -> None:
    s = S3Storage(f"s3://{s3_bucket}/a/b/")
    assert (s.bucket, s.prefix, s._key(3, "x")) == (s3_bucket, "a/b", "a/b/step-00000003/x")
    with pytest.raises(ValueError):
        S3Storage("s3:///nobucket")
