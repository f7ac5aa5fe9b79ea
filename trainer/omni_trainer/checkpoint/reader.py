"""Resuming: which step to continue from, and loading it into any layout.

The newest step complete in either tier wins; a persistent step whose checksums do not verify
is skipped for the one before it; another job's checkpoint is refused before the root is
claimed. Every rank takes part and gets the same answer (rank 0 decides, the group hears it).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from omni_trainer.checkpoint.collectives import CheckpointGroup
from omni_trainer.checkpoint.config import FAST
from omni_trainer.checkpoint.fast_io import FastTierIO
from omni_trainer.checkpoint.fast_tier import FastPlan, latest_fast, newest_tier
from omni_trainer.checkpoint.loader_state import SHARED, deserialize, file_for
from omni_trainer.checkpoint.ownership import RootOwnership
from omni_trainer.checkpoint.state import ModelState, load_targets
from omni_trainer.checkpoint.storage import CheckpointStorage, step_name
from omni_trainer.checkpoint.verify import mismatches, share

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """Where a restart continues: ``step`` optimizer steps done, the loader state of then."""

    step: int
    loader_state: Any | None
    layout: dict[str, Any]


class CheckpointReader:
    """Finds the step to resume from and loads it on every rank.

    Args:
        storage: the persistent tier.
        ranks: the checkpoint's process group.
        ownership: the attempt and job resuming (owner check, then claim).
        scratch: this rank's local directory for downloads (removed after each load).
        fast: the node-local tier, with ``checkpoint.fast``.
    """

    def __init__(
        self,
        *,
        storage: CheckpointStorage,
        ranks: CheckpointGroup,
        ownership: RootOwnership,
        scratch: Path,
        fast: FastTierIO | None,
    ) -> None:
        self.storage = storage
        self.ranks = ranks
        self.ownership = ownership
        self.scratch = scratch
        self.fast = fast

    # -- which step ------------------------------------------------------------------------
    def latest(self) -> tuple[int | None, FastPlan | None]:
        """The newest step complete in either tier whose checksums verify, and the fast-tier
        plan when it wins; a persistent step that fails verification is skipped for the one
        before it (every rank takes part in verifying, and gets the same answer).

        Raises:
            Fenced: on every rank, when a newer attempt already claimed the storage.
            ForeignCheckpoint: on every rank, when the checkpoint belongs to another job.
        """
        inventories = self.ranks.all_gather(self.fast.node.inventory()) if self.fast else []
        skip: list[int] = []
        while True:
            step, plan = self._select(inventories, skip)
            if step is None or plan is not None or not (bad := self._verify(step)):
                break
            if self.ranks.rank == 0:
                where = f"{self.storage.url}/{step_name(step)}"
                log.warning("checkpoint %s skipped (checksums), falling back to the previous "
                            "committed step: %s", where, "; ".join(bad))  # fmt: skip
            skip.append(step)
        self.ranks.on_rank0(lambda: self.storage.resumed_from(step))
        return step, plan

    def _select(
        self, inventories: list[Any], skip: list[int]
    ) -> tuple[int | None, FastPlan | None]:
        """Rank 0's choice (owner checked, the root claimed), broadcast to every rank."""

        def choose() -> tuple[int | None, FastPlan | None]:
            newest = next(iter(reversed(self.storage.list_steps())), None)
            self.ownership.check_step(newest)  # before the claim: never fence another job's root
            self.ownership.claim()
            persistent = self.storage.latest_complete(skip)
            plan = latest_fast(inventories, self.storage.read_fence()) if self.fast else None
            if newest_tier(persistent, plan.step if plan else None) == FAST:
                self.ownership.check_marker(plan.marker, step=f"{step_name(plan.step)} (fast tier)")
                return plan.step, plan
            self.ownership.check_step(persistent)
            return persistent, None

        return self.ranks.on_rank0(choose)

    def _verify(self, step: int) -> list[str]:
        """The files of ``step`` whose sha256 differs from its marker's (every rank hashes its
        share, streamed, in threads; all get the whole list)."""
        rank = self.ranks.rank
        marker = self.ranks.broadcast(self.storage.read_marker(step) if rank == 0 else None)
        files = (marker or {}).get("files") or {}
        mine = share(files, rank, self.ranks.world)
        bad = mismatches(partial(self.storage.open_file, step), files, mine)
        return sorted(m for part in self.ranks.all_gather(bad) for m in part)

    # -- loading ---------------------------------------------------------------------------
    def load_latest(self, state: ModelState) -> Resume | None:
        """Load the newest checkpoint complete in either tier into ``state`` (any layout);
        None when there is none."""
        step, plan = self.latest()
        if step is None:
            return None
        return self.load(step, state) if plan is None else self._load_fast(plan, state)

    def _load_fast(self, plan: FastPlan, state: ModelState) -> Resume:
        """Gather a fast-tier step from the nodes holding its files, then load it."""
        download = self.scratch / "load" / step_name(plan.step)
        self.fast.gather(plan, download)
        read = lambda rel: (download / rel).read_bytes()  # noqa: E731
        return self._load_from(download, plan.marker, state, read=read, cleanup=download)

    def load(self, step: int, state: ModelState) -> Resume:
        """Load persistent checkpoint ``step`` into this rank's parameters and optimizer state."""
        marker = self.storage.read_marker(step)
        if marker is None:
            raise FileNotFoundError(f"{self.storage.url}/{step_name(step)} is not committed")
        download = self.scratch / "load" / step_name(step)
        root = self.storage.fetch(step, download, prefix="model/")
        read = partial(self.storage.read_bytes, step)
        return self._load_from(root, marker, state, read=read, cleanup=download)

    def _load_from(
        self,
        root: Path,
        marker: dict[str, Any],
        state: ModelState,
        *,
        read: Callable[[str], bytes | None],
        cleanup: Path,
    ) -> Resume:
        """Load a step's ``model/`` files under ``root`` and this rank's loader file through
        ``read``; ``cleanup`` is removed after (a download, never the persistent root)."""
        try:
            reader = FileSystemReader(root / "model")
            available = {
                key: (meta.size, meta.properties.dtype)
                for key, meta in reader.read_metadata().state_dict_metadata.items()
                if isinstance(meta, TensorStorageMetadata)
            }
            targets, apply = load_targets(state, available)
            dcp.load(
                targets,
                storage_reader=reader,
                planner=DefaultLoadPlanner(),
                process_group=self.ranks.group,
                no_dist=not self.ranks.distributed,
            )
            apply()
            loader = None
            rel = file_for(self.ranks.rank, marker.get("loader", SHARED))
            if rel in marker["files"]:
                raw = read(rel)
                loader = None if raw is None else deserialize(raw)
        finally:
            shutil.rmtree(cleanup, ignore_errors=True)
        self.ranks.barrier()
        return Resume(step=marker["step"], loader_state=loader, layout=marker.get("layout", {}))
