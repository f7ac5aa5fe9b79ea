"""The background part of a save: write, upload and commit one step, in either tier.

Runs off the training loop when saves are asynchronous (the :class:`BackgroundSaver` thread of
:class:`~omni_trainer.checkpoint.checkpointer.Checkpointer`). Every rank runs the same
collectives whatever fails where, so one rank's failure never leaves another waiting: it is
gathered, and rank 0 then does not commit.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner

from omni_trainer.checkpoint.async_save import write_share
from omni_trainer.checkpoint.collectives import CheckpointGroup
from omni_trainer.checkpoint.config import FAST, CheckpointConfig
from omni_trainer.checkpoint.fast_io import FastTierIO, MarkerInfo
from omni_trainer.checkpoint.ownership import RootOwnership
from omni_trainer.checkpoint.storage import CheckpointStorage, FileEntry, step_name

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    """How one save went; ``committed`` only when every rank's files are stored."""

    step: int
    committed: bool
    blocking_s: float
    """Time the training loop waited (host copy + loader snapshot)."""
    background_s: float = 0.0
    """Time of the write/upload/commit, off the training loop when asynchronous."""
    errors: list[str] = field(default_factory=list)


class CheckpointWriter:
    """Writes staged state of one rank and commits the step on rank 0.

    Args:
        config: the manifest's ``checkpoint`` section (retention: ``keepLast``, ``fast``).
        storage: the persistent tier.
        ranks: the checkpoint's process group.
        ownership: the attempt and job writing (claim, marker fields).
        layout: the parallel layout recorded in the commit marker.
        loader_scope: ``"shared"`` or ``"per_rank"``, recorded in the marker.
        scratch: this rank's local directory for a remote store's files before upload.
        planner: the DCP save planner (its cached plans) of the persistent tier.
        fast: the node-local tier, with ``config.fast``.
    """

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        storage: CheckpointStorage,
        ranks: CheckpointGroup,
        ownership: RootOwnership,
        layout: dict[str, Any],
        loader_scope: str,
        scratch: Path,
        planner: DefaultSavePlanner,
        fast: FastTierIO | None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.ranks = ranks
        self.ownership = ownership
        self.layout = layout
        self.loader_scope = loader_scope
        self.scratch = scratch
        self.planner = planner
        self.fast = fast

    def persistent(
        self, step: int, staged: dict[str, Any], loader: Any | None, blocking: float
    ) -> SaveResult:
        """DCP write, loader state, upload, then the commit and retention on rank 0.

        Rank 0's preparation is agreed on before DCP's collective write, which all ranks then
        run or all skip (the store down for one rank and not another); each rank's failure is
        gathered at the end."""
        start = time.perf_counter()
        storage, rank = self.storage, self.ranks.rank
        files: dict[str, FileEntry] = {}
        error: str | None = None
        local = storage.local_dir(step) or self.scratch / step_name(step)
        try:
            self._claim_once()
            if rank == 0 and step in storage.list_steps():
                storage.remove(step)  # a partial save of this step from a crashed run
        except Exception as exc:
            error = self._failed(step, exc)
        prepared = [e for e in self.ranks.all_gather(error) if e is not None]
        if prepared and error is None:
            error = f"rank {rank}: not written: {prepared[0]}"
        try:
            if not prepared:
                files = write_share(storage, step, staged, loader, local=local, rank=rank,
                                    planner=self.planner, group=self.ranks.group)  # fmt: skip
            del staged
            if storage.local_dir(step) is None:
                for rel in sorted(files):
                    if rel.startswith("model/"):
                        storage.upload(step, rel, local / rel)
        except Exception as exc:  # reported to rank 0, which then does not commit
            error = self._failed(step, exc)
        finally:
            if storage.local_dir(step) is None:
                shutil.rmtree(local, ignore_errors=True)
        reports = self.ranks.all_gather((files, error))
        errors = [e for _, e in reports if e is not None]
        committed = self._commit(step, reports, errors) if rank == 0 and not errors else False
        committed = self.ranks.broadcast(committed)
        return SaveResult(
            step=step,
            committed=committed,
            blocking_s=blocking,
            background_s=time.perf_counter() - start,
            errors=errors,
        )

    def _commit(
        self, step: int, reports: list[tuple[dict[str, FileEntry], str | None]], errors: list[str]
    ) -> bool:
        """Rank 0: the commit marker over every rank's files, then retention; whether the marker
        is written (a failure of either is appended to ``errors``)."""
        committed = False
        try:
            merged = {rel: entry for part, _ in reports for rel, entry in part.items()}
            extra = self.ownership.marker_extra(self.loader_scope)
            self.storage.commit(step, merged, layout=self.layout, extra=extra)
            committed = True
            self.storage.retain(self.config.keep_last)
        except Exception as exc:
            log.exception("checkpoint %s: commit or retention failed", step_name(step))
            errors.append(f"rank 0: {type(exc).__name__}: {exc}")
        return committed

    def fast_tier(
        self, step: int, staged: dict[str, Any], loader: Any | None, blocking: float
    ) -> SaveResult:
        """A fast-tier save (see :meth:`FastTierIO.write`)."""
        start = time.perf_counter()
        try:
            self._claim_once()
        except Exception as exc:  # Fenced: FastTierIO's fence check refuses the commit too
            log.error("fast checkpoint %s: claim failed: %s", step_name(step), exc)
        extra = self.ownership.marker_extra(self.loader_scope)
        info = MarkerInfo(self.layout, {**extra, "tier": FAST})
        errors = self.fast.write(
            step,
            staged,
            loader,
            fence_keeper=self.storage,
            info=info,
            keep_last=self.config.fast.keep_last,
        )
        return SaveResult(
            step=step,
            committed=not errors,
            blocking_s=blocking,
            background_s=time.perf_counter() - start,
            errors=errors,
        )

    def _claim_once(self) -> None:
        """Rank 0 claims the persistent root for its attempt (a run that did not resume)."""
        if self.ranks.rank == 0:
            self.ownership.claim_once()

    def _failed(self, step: int, exc: Exception) -> str:
        log.exception("rank %d: checkpoint %s failed", self.ranks.rank, step_name(step))
        return f"rank {self.ranks.rank}: {type(exc).__name__}: {exc}"
