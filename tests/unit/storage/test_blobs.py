"""Storage reads: transient errors are retried with backoff, a missing object fails at once."""

from __future__ import annotations

import builtins

import pytest

from omni_trainer.storage import blobs


def test_transient_errors_are_retried_then_succeed(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"0123456789")
    real_open, calls, sleeps = builtins.open, [], []

    def flaky(file, *args, **kwargs):
        if str(file) == str(path):
            calls.append(file)
            if len(calls) <= 2:
                raise TimeoutError("slow storage")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", flaky)
    monkeypatch.setattr(blobs.time, "sleep", sleeps.append)
    assert blobs.read_bytes(str(path), 2, 5) == b"234"
    assert len(calls) == 3 and sleeps == [blobs.BACKOFF_S, 2 * blobs.BACKOFF_S]


def test_persistent_errors_fail_after_the_retries_and_missing_fails_at_once(tmp_path, monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(blobs.time, "sleep", sleeps.append)
    with pytest.raises(FileNotFoundError):
        blobs.read_bytes(str(tmp_path / "absent"))
    assert sleeps == []
    monkeypatch.setattr(builtins, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("EIO")))
    with pytest.raises(OSError, match="after 5 attempts"):
        blobs.read_bytes(str(tmp_path / "x"))
    assert len(sleeps) == blobs.RETRIES
