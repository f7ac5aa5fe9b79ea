"""The fast tier's I/O over the checkpoint's process group: a save (this node's disk, the copy
to the peer node, the marker on every node) and the gathering of a step to resume from.

The rules (which step counts, which tier wins) live in :mod:`omni_trainer.checkpoint.fast_tier`;
this module only moves bytes, with collectives on the checkpoint's own gloo group (every rank
calls every method at the same point, errors included, so no rank waits alone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner

from omni_trainer.checkpoint.async_save import write_share
from omni_trainer.checkpoint.fast_tier import FastPlan, NodeTier, peer_of, source_of
from omni_trainer.checkpoint.storage import (
    CheckpointStorage,
    FileEntry,
    step_name,
)
from omni_trainer.distributed import comm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarkerInfo:
    """What a fast step's marker records besides its files (as the persistent tier's)."""

    layout: dict[str, Any]
    extra: dict[str, Any]


class FastTierIO:
    """One rank's side of the fast tier.

    Args:
        node: this rank's node-local directory.
        group: the checkpoint's process group over all ranks (None: a single process).
        rank, world: this rank and the world size.
        local_world: ranks per node (numbered node by node): the peer is rank + local_world.
        planner: the DCP save planner of the fast tier (its plans cached apart from the
            persistent tier's).
    """

    def __init__(
        self,
        node: NodeTier,
        *,
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        local_world: int,
        planner: DefaultSavePlanner,
    ) -> None:
        self.node, self.group, self.planner = node, group, planner
        self.rank, self.world, self.local_world = rank, world, local_world

    def write(
        self,
        step: int,
        staged: dict[str, Any],
        loader: Any | None,
        *,
        fence_keeper: CheckpointStorage,
        info: MarkerInfo,
        keep_last: int,
    ) -> list[str]:
        """Save ``step``: DCP onto this node's disk, the copy to the peer node (an all-to-all
        where each rank sends its files only to its peer), then a marker on every node once
        rank 0 checked every rank's report and ``fence_keeper``'s fence (the persistent tier:
        node-local disks cannot hold a gang-wide fence).

        Returns:
            The errors (empty: committed).
        """
        node, errors = self.node, []
        try:
            if self.rank % self.local_world == 0 and step in node.storage.list_steps():
                node.storage.delete_step(step)  # a partial save of this step (a crashed run)
        except OSError as exc:
            errors.append(f"rank {self.rank}: {type(exc).__name__}: {exc}")
        comm.barrier(self.group)
        files: dict[str, FileEntry] = {}
        own: dict[str, bytes] = {}
        local = node.storage.local_dir(step)
        try:
            files = write_share(node.storage, step, staged, loader, local=local, rank=self.rank,
                                planner=self.planner, group=self.group)  # fmt: skip
            del staged
            own = node.read(step, sorted(files))
        except Exception as exc:
            log.exception("rank %d: fast checkpoint %s failed", self.rank, step_name(step))
            errors.append(f"rank {self.rank}: {type(exc).__name__}: {exc}")
        errors += self._copy_to_peer(step, own)
        reports = comm.all_gather_object((files, errors), group=self.group)
        errors = [e for _, errs in reports for e in errs]
        decision: tuple[bytes | None, Any] = (None, None)
        if self.rank == 0 and not errors:
            try:
                fence = fence_keeper.check_fence()
                merged = {rel: entry for part, _ in reports for rel, entry in part.items()}
                marker = fence_keeper.marker(step, merged, info.layout, info.extra)
                decision = (marker, fence)
            except Exception as exc:
                errors.append(f"rank 0: {type(exc).__name__}: {exc}")
        marker, fence = comm.broadcast_object(decision, src=0, group=self.group)
        if marker is not None:
            node.commit(step, marker)
            node.retain(keep_last, fence)
        elif not errors:
            errors.append("rank 0 refused the commit (see its log)")
        return errors

    def _copy_to_peer(self, step: int, own: dict[str, bytes]) -> list[str]:
        """Send this rank's files to its peer and keep its source's; the errors."""
        peer = peer_of(self.rank, world=self.world, local_world=self.local_world)
        if peer is None:
            return []
        outgoing: list[Any] = [None] * self.world
        outgoing[peer] = own
        received = comm.exchange_objects(outgoing, group=self.group)
        source = source_of(self.rank, world=self.world, local_world=self.local_world)
        try:
            self.node.keep(step, received[source] or {})
        except Exception as exc:
            return [f"rank {self.rank} keeping rank {source}'s copy: {exc}"]
        return []

    def gather(self, plan: FastPlan, dest: Path) -> None:
        """Every file of ``plan``'s step into ``dest``, each broadcast by one node holding it
        (per rank the same volume as a resume from S3, which downloads every file)."""
        for rel in sorted(plan.marker["files"]):
            source = plan.sources[rel]
            data = self.node.read(plan.step, [rel])[rel] if self.rank == source else None
            data = comm.broadcast_object(data, src=source, group=self.group)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
