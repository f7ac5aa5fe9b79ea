"""Fenced attempts: once a newer restart attempt resumed, an older one (its pods still within
their grace period) can neither commit nor delete, on a directory and on S3 (moto server)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.storage import (
    CheckpointStorage,
    Fenced,
    FilesystemStorage,
    S3Storage,
    open_storage,
)

from .test_checkpoint_storage import put_step
from .test_checkpointer import trained

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(params=["fs", "s3"])
def url(request, tmp_path: Path) -> str:
    if request.param == "fs":
        return str(tmp_path / "ckpt")
    return f"s3://{request.getfixturevalue('s3_bucket')}/jobs/a"


def test_a_superseded_attempt_can_neither_commit_nor_delete(url: str, tmp_path: Path) -> None:
    old, new = open_storage(url), open_storage(url)
    old.claim(0)
    for step in (10, 20):
        put_step(old, step, tmp_path)
    new.claim(1)
    new.resumed_from(new.latest_complete())
    with pytest.raises(Fenced, match="superseded by attempt 1"):
        put_step(old, 30, tmp_path)  # files land, the commit is refused
    with pytest.raises(Fenced):
        old.retain(1)
    with pytest.raises(Fenced):
        old.remove(20)
    with pytest.raises(Fenced):
        old.claim(0)  # a late restart of the old attempt does not take the root back
    assert new.latest_complete() == 20 and old.read_marker(30) is None
    put_step(new, 30, tmp_path)  # the new attempt commits (its step 30 replaces nothing)
    assert new.retain(1) == [10] and new.latest_complete() == 30  # 20: its resume step


def test_a_commit_that_slipped_past_the_fence_is_not_counted(url: str, tmp_path: Path) -> None:
    """The fence is checked, then the marker is written: an old attempt that checked just
    before the newer one claimed still writes its marker. Readers skip it (it is past the
    step the newer attempt resumed from) and retention keeps the newer one's resume step."""
    old, new = open_storage(url), open_storage(url)
    old.claim(0)
    put_step(old, 10, tmp_path)
    new.claim(1)
    new.resumed_from(10)
    old.check_fence = lambda: None  # the check happened before the claim
    put_step(old, 20, tmp_path)
    assert old.read_marker(20)["attempt"] == 0
    assert new.latest_complete() == 10
    assert "superseded attempt" in (new.problem(20, new.read_fence()) or "")
    put_step(new, 11, tmp_path)
    assert new.retain(1) == [] and new.latest_complete() == 11  # 10: the resume step stays


def test_markers_are_never_overwritten(url: str, tmp_path: Path) -> None:
    storage = open_storage(url)
    put_step(storage, 10, tmp_path)
    with pytest.raises(Exception):  # noqa: B017 (FileExistsError on a directory, 412 on S3)
        storage.write_marker(10, b"{}")
    assert storage.read_marker(10)["step"] == 10


def test_concurrent_claims_serialize(url: str) -> None:
    """Claims are compare-and-swap: the highest attempt wins whatever the interleaving."""
    errors: list[BaseException] = []

    def claim(attempt: int) -> None:
        try:
            open_storage(url).claim(attempt)
        except Fenced as err:
            errors.append(err)

    threads = [threading.Thread(target=claim, args=(a,)) for a in (3, 1, 4, 2, 5, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert open_storage(url).read_fence()["attempt"] == 5
    assert all(isinstance(e, Fenced) for e in errors)


class SlowStorage(FilesystemStorage):
    """Uploads wait for a gate: the old attempt's save is still in flight when it is fenced."""

    def __init__(self, root: Path, gate: threading.Event) -> None:
        super().__init__(root)
        self.gate = gate

    def write_bytes(self, step: int, rel: str, data: bytes) -> None:
        if rel.startswith("loader/"):
            self.gate.wait(30)
        super().write_bytes(step, rel, data)


def test_an_old_attempts_delayed_commit_is_refused_and_the_resume_step_survives(
    tmp_path: Path,
) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"), keep_last=1)
    _, state = trained()
    gate = threading.Event()
    gate.set()  # open for the first save
    old = Checkpointer(config, attempt=0, storage=SlowStorage(tmp_path / "ck", gate))
    assert old.load_latest(state) is None  # attempt 0 claims the storage
    old.save(10, state, {"step": 10})
    assert old.wait().committed
    gate.clear()
    old.save(20, state, {"step": 20})  # in flight: its loader file waits for the gate

    _, fresh = trained(seed=1)
    new = Checkpointer(config, attempt=1)
    resume = new.load_latest(fresh)  # attempt 1 resumes from 10 while attempt 0 still saves
    assert resume is not None and resume.step == 10
    gate.set()
    result = old.close()
    assert not result.committed and "superseded by attempt 1" in " ".join(result.errors)
    storage: CheckpointStorage = new.storage
    assert storage.latest_complete() == 10 and storage.read_marker(20) is None
    assert storage.problem(10) is None  # keep_last=1 retention of step 20 never ran
    with pytest.raises(Fenced):
        Checkpointer(config, attempt=0).load_latest(state)


def test_attempt_comes_from_the_operators_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"))
    assert Checkpointer(config).ownership.attempt is None  # a local run: unfenced
    monkeypatch.setenv("OMNI_RESTART_ATTEMPT", "3")
    assert Checkpointer(config).ownership.attempt == 3


def test_s3_claims_use_conditional_writes(s3_bucket: str) -> None:
    storage = S3Storage(f"s3://{s3_bucket}/run")
    sent: list[dict] = []
    storage.client.meta.events.register(
        "before-parameter-build.s3.PutObject", lambda params, **_: sent.append(dict(params))
    )
    storage.claim(0)
    storage.claim(1)
    conds = [{k for k in p if k.startswith("If")} for p in sent]
    assert conds == [{"IfNoneMatch"}, {"IfMatch"}]
