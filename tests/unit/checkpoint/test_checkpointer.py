"""Checkpointer in one process: async round trip, S3, a failed upload commits nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.state import ModelState
from omni_trainer.checkpoint.storage import S3Storage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def trained(seed: int = 0, steps: int = 2, width: int = 16) -> tuple[nn.Module, ModelState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(steps):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, ModelState(llm={}, replicated=dict(model.named_parameters()), optimizer=opt)


def assert_same(a: ModelState, b: ModelState) -> None:
    for name, p in a.replicated.items():
        q = b.replicated[name]
        assert torch.equal(p, q), name
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_on_a_directory(tmp_path: Path, async_save: bool) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"), keep_last=2, async_save=async_save)
    model, state = trained()
    ckpt = Checkpointer(config)
    ckpt.save(2, state, {"cursors": [4, 5]})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # the loop moves on while the save runs: the snapshot must not
        for p in model.parameters():
            p.add_(1.0)
    result = ckpt.close()
    assert result.committed and result.step == 2 and not result.errors
    _, fresh = trained(seed=1, steps=1)
    resume = Checkpointer(config).load_latest(fresh)
    assert resume.step == 2 and resume.loader_state == {"cursors": [4, 5]}
    for name, p in fresh.replicated.items():
        assert torch.equal(p, saved[name]), name


def test_round_trip_on_s3_with_retention(s3_bucket: str, tmp_path: Path) -> None:
    config = CheckpointConfig(
        path=f"s3://{s3_bucket}/run", keep_last=2, staging_dir=str(tmp_path / "scratch")
    )
    _, state = trained()
    ckpt = Checkpointer(config)
    for step in (1, 2, 3):
        ckpt.save(step, state, {"step": step})
    assert ckpt.close().committed
    assert ckpt.storage.list_steps() == [2, 3]
    _, fresh = trained(seed=1, steps=1)
    resume = Checkpointer(config).load_latest(fresh)
    assert resume.step == 3 and resume.loader_state == {"step": 3}
    assert_same(state, fresh)


def test_failed_upload_leaves_no_complete_checkpoint(s3_bucket: str, tmp_path: Path) -> None:
    storage = S3Storage(
        f"s3://{s3_bucket}/run", multipart_threshold=5 << 20, multipart_chunksize=5 << 20
    )
    config = CheckpointConfig(path=storage.url, staging_dir=str(tmp_path / "scratch"))
    _, state = trained(width=1 << 17)  # ~ 12 MB of weights + 24 MB of Adam state: multipart
    ckpt = Checkpointer(config, storage=storage)
    ckpt.save(1, state, {"step": 1})
    assert ckpt.wait().committed

    parts = []

    def fail_after_first_part(**_kwargs) -> None:
        parts.append(1)
        if len(parts) > 1:
            raise ConnectionError("injected: connection reset during UploadPart")

    storage.client.meta.events.register("before-call.s3.UploadPart", fail_after_first_part)
    ckpt.save(2, state, {"step": 2})
    result = ckpt.close()
    assert not result.committed and "injected" in result.errors[0]
    assert len(parts) > 1
    assert storage.read_marker(2) is None
    assert storage.latest_complete() == 1
    uploads = storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert uploads == []  # the aborted multipart upload left nothing behind


def test_a_partial_step_is_replaced_by_a_new_save(tmp_path: Path) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"))
    _, state = trained()
    ckpt = Checkpointer(config)
    ckpt.storage.write_bytes(4, "model/__0_0.distcp", b"left by a crashed run")
    assert ckpt.storage.latest_complete() is None
    ckpt.save(4, state)
    assert ckpt.close().committed
    assert ckpt.storage.latest_complete() == 4


def test_nothing_to_resume(tmp_path: Path) -> None:
    _, state = trained()
    assert Checkpointer(CheckpointConfig(path=str(tmp_path / "none"))).load_latest(state) is None


def test_config_reads_the_manifest_spelling() -> None:
    cfg = CheckpointConfig.model_validate(
        {"path": "s3://b/p", "intervalSteps": 50, "keepLast": 2, "async": False}
    )
    assert (cfg.interval_steps, cfg.keep_last, cfg.async_save, cfg.is_s3()) == (50, 2, False, True)
    assert cfg.due(100) and not cfg.due(0) and not cfg.due(51)


def test_a_save_retrying_on_a_store_that_is_down_is_stuck(s3_bucket: str, tmp_path: Path) -> None:
    """A save whose requests fail and are retried (the store refuses connections) says it is
    stuck while it runs, so the loop can skip the next periodic save instead of waiting; a
    healthy save never does, and neither does a finished one."""
    import socket
    import time

    import boto3
    from botocore.config import Config

    _, state = trained()
    healthy = Checkpointer(CheckpointConfig(path=f"s3://{s3_bucket}/ok",
                                            staging_dir=str(tmp_path / "a")))  # fmt: skip
    healthy.save(1, state, {"step": 1})
    assert not healthy.stuck
    assert healthy.close().committed and not healthy.stuck

    with socket.socket() as s:  # a port nobody listens on: every connection is refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = boto3.session.Session().client(
        "s3", endpoint_url=dead, config=Config(retries={"max_attempts": 5, "mode": "standard"})
    )
    storage = S3Storage(f"s3://{s3_bucket}/down", client=client)
    down = Checkpointer(CheckpointConfig(path=storage.url, staging_dir=str(tmp_path / "b")),
                        storage=storage)  # fmt: skip
    down.save(1, state, {"step": 1})
    deadline = time.monotonic() + 10
    while not down.stuck and time.monotonic() < deadline:
        time.sleep(0.02)
    assert down.stuck  # retrying, long before the save gives up
    result = down.close()
    assert not result.committed and "Could not connect" in result.errors[0]
    assert not down.stuck
