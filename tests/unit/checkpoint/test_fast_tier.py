"""The fast tier's rules: a step counts when every listed file survives on its writer's node
or on its peer's; the newest step of either tier wins; a superseded attempt's commit neither
commits nor counts; the manifest rejects a fast tier that is not faster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.fast_tier import (
    Held,
    Inventory,
    latest_fast,
    missing,
    newest_tier,
    peer_of,
    source_of,
)
from omni_trainer.checkpoint.storage import Fenced, FilesystemStorage

from .test_checkpointer import assert_same, trained

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FILES = {"model/__0_0.distcp": 10, "model/__1_0.distcp": 11, "model/.metadata": 3}


def marker(step: int, attempt: int | None = 0) -> dict:
    files = {rel: {"size": size, "sha256": ""} for rel, size in FILES.items()}
    return {"step": step, "attempt": attempt, "files": files}


def node(step: int, rels: list[str], *, committed: bool = True, attempt: int = 0) -> Inventory:
    """One node's holdings of ``step``: the listed files (with their right sizes)."""
    return {step: Held(marker(step, attempt) if committed else None, {r: FILES[r] for r in rels})}


# Two nodes of one rank each: rank 0 on node a (its peer: node b), rank 1 on node b.
OWN_A = ["model/__0_0.distcp", "model/.metadata"]
OWN_B = ["model/__1_0.distcp"]


def test_a_share_missing_on_its_node_but_held_by_its_peer_counts() -> None:
    lost_b = {}  # node b was lost: a fresh node holds nothing
    a = node(4, OWN_A + OWN_B)  # node a keeps its own files and b's copy
    assert missing(4, [a, lost_b], None) is None
    plan = latest_fast([lost_b, a], None)
    assert plan.step == 4 and set(plan.sources.values()) == {1}  # all from the survivor


def test_a_share_missing_on_both_its_node_and_its_peer_does_not_count() -> None:
    a = node(4, OWN_A)  # b's copy never arrived on a, and b is gone
    assert "__1_0.distcp is missing" in missing(4, [a, {}], None)
    assert latest_fast([a, {}], None) is None


def test_a_wrong_size_or_no_marker_does_not_count() -> None:
    short = {4: Held(marker(4), {**FILES, "model/__1_0.distcp": 5})}
    assert "missing" in missing(4, [short], None)
    uncommitted = node(4, list(FILES), committed=False)
    assert missing(4, [uncommitted], None) == "no node holds a valid commit marker"


def test_the_newest_complete_step_wins_and_newer_partial_ones_are_skipped() -> None:
    a = {**node(4, list(FILES)), **node(6, OWN_A, committed=False)}
    b = node(6, OWN_B, committed=False)
    assert latest_fast([a, b], None).step == 4  # 6: no marker anywhere (a save in flight)
    b_committed = node(6, OWN_B)  # one node's marker: rank 0 had decided the commit
    assert latest_fast([a, b_committed], None).step == 6


def test_newest_across_tiers_wins() -> None:
    assert newest_tier(None, None) is None
    assert newest_tier(10, None) == "persistent" and newest_tier(None, 3) == "fast"
    assert newest_tier(10, 12) == "fast" and newest_tier(10, 8) == "persistent"
    assert newest_tier(10, 10) == "persistent"  # a tie: the durable one


def test_a_superseded_attempts_fast_commit_past_the_resume_does_not_count() -> None:
    fence = {"attempt": 2, "resumedFrom": 4}
    inv = {**node(4, list(FILES), attempt=1), **node(6, list(FILES), attempt=1)}
    assert "superseded attempt 1" in missing(6, [inv], fence)
    assert latest_fast([inv], fence).step == 4


def test_peers_are_the_same_local_rank_on_the_next_node() -> None:
    peers = [peer_of(r, world=6, local_world=2) for r in range(6)]
    assert peers == [2, 3, 4, 5, 0, 1]
    assert [source_of(p, world=6, local_world=2) for p in peers] == list(range(6))
    assert peer_of(0, world=2, local_world=2) is None  # one node: no peer


def test_the_manifest_rejects_a_fast_tier_that_is_not_faster() -> None:
    with pytest.raises(ValidationError, match=r"fast.intervalSteps \(10\) must be smaller"):
        CheckpointConfig.model_validate(
            {"path": "/ck", "intervalSteps": 10, "fast": {"path": "/f", "intervalSteps": 10}}
        )
    with pytest.raises(ValidationError, match="absolute node-local directory"):
        CheckpointConfig.model_validate(
            {"path": "/ck", "fast": {"path": "s3://b/f", "intervalSteps": 1}}
        )
    cfg = CheckpointConfig.model_validate(
        {"path": "/ck", "intervalSteps": 6, "fast": {"path": "/f", "intervalSteps": 2}}
    )
    assert [cfg.tier_due(s) for s in range(7)] == [None, None, "fast", None, "fast", None,
                                                   "persistent"]  # fmt: skip


def config(tmp_path: Path, keep: int = 2) -> CheckpointConfig:
    fast = {"path": str(tmp_path / "node"), "intervalSteps": 1, "keepLast": keep}
    return CheckpointConfig.model_validate(
        {"path": str(tmp_path / "pvc"), "intervalSteps": 3, "fast": fast}
    )


def test_resume_takes_the_newest_tier_and_restores_exactly(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    _, old = trained(seed=0)
    _, new = trained(seed=2)
    ckpt = Checkpointer(cfg)
    ckpt.save(3, old, {"step": 3})
    ckpt.save(4, new, {"step": 4}, tier="fast")
    ckpt.save(5, new, {"step": 5}, tier="fast")
    ckpt.save(6, new, {"step": 6}, tier="fast")
    assert ckpt.close().committed
    assert ckpt.fast.node.storage.list_steps() == [5, 6]  # fast retention: keepLast 2
    assert ckpt.storage.list_steps() == [3]  # the persistent tier untouched
    _, fresh = trained(seed=1, steps=1)
    resume = Checkpointer(cfg).load_latest(fresh)
    assert resume.step == 6 and resume.loader_state == {"step": 6}
    assert_same(new, fresh)
    for step in (5, 6):  # the fast tier lost: the persistent step
        ckpt.fast.node.storage.delete_step(step)
    _, fresh = trained(seed=1, steps=1)
    resume = Checkpointer(cfg).load_latest(fresh)
    assert resume.step == 3 and resume.loader_state == {"step": 3}
    assert_same(old, fresh)


def test_a_superseded_attempt_cannot_commit_to_the_fast_tier(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    _, state = trained()
    old = Checkpointer(cfg, attempt=0, cache_plans=False)
    old.save(1, state, {"step": 1}, tier="fast")
    assert old.wait().committed
    new = Checkpointer(cfg, attempt=1)
    assert new.latest_step() == 1  # attempt 1 claimed the fence and resumed from step 1
    old.save(2, state, {"step": 2}, tier="fast")
    result = old.close()
    assert not result.committed and "superseded by attempt 1" in " ".join(result.errors)
    assert new.fast.node.storage.read_marker(2) is None and new.latest_step() == 1
    with pytest.raises(Fenced):
        old.storage.check_fence()


def test_a_step_stored_twice_is_replaced_not_mixed(tmp_path: Path) -> None:
    """A crashed run left a partial fast step: the next save of that step starts it over."""
    cfg = config(tmp_path)
    stale = FilesystemStorage(cfg.fast.path)
    stale.write_bytes(2, "model/__9_0.distcp", b"stale")
    _, state = trained()
    ckpt = Checkpointer(cfg)
    ckpt.save(2, state, {"step": 2}, tier="fast")
    assert ckpt.close().committed
    files = json.loads(stale.read_bytes(2, "COMMITTED"))["files"]
    assert "model/__9_0.distcp" not in stale.list_files(2) and "loader/rank-00000.json" in files
