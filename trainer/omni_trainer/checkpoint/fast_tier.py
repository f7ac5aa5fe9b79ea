"""The fast checkpoint tier: every rank's share on its node's local disk and on a peer node.

Layout: each node's ``checkpoint.fast.path`` holds the same ``step-*`` directories as the
persistent tier (see :mod:`omni_trainer.checkpoint.storage`), but each only with the files its
ranks wrote plus the copies their source ranks sent (rank r's peer is rank r + L, the same
local rank on the next node, L ranks per node). Node-local disks are not shared on a real
cluster, so the copy travels over the checkpoint's gloo group (an all-to-all in which each rank
sends only to its peer) and the peer writes it: no shared mount is assumed.

A step counts when a valid commit marker (every node holds one, with the full file list) is
found on any node and every listed file is held, with its size, by some surviving node: its
writer's or its peer's. A lost node therefore loses nothing; a lost node and its peer together
lose the step. Fencing uses the persistent tier's fence (node-local disks cannot hold a
gang-wide one): a superseded attempt's fast commits are refused and, if one slipped through,
not counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_trainer.checkpoint.storage import (
    MARKER,
    FilesystemStorage,
    doomed_steps,
    step_name,
    superseded,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """What one rank's node holds of one step: its marker (None: none or invalid), its files."""

    marker: dict[str, Any] | None
    files: dict[str, int]


Inventory = dict[int, Held]
"""step -> what one rank's node holds of it."""


@dataclass(frozen=True)
class FastPlan:
    """A fast-tier step to resume from: its marker and, per file, a rank whose node holds it."""

    step: int
    marker: dict[str, Any]
    sources: dict[str, int]


def peer_of(rank: int, *, world: int, local_world: int) -> int | None:
    """The rank on the next node that keeps ``rank``'s copy (None on a single node)."""
    return None if world <= local_world else (rank + local_world) % world


def source_of(rank: int, *, world: int, local_world: int) -> int | None:
    """The rank whose copy ``rank`` keeps (the inverse of :func:`peer_of`)."""
    return None if world <= local_world else (rank - local_world) % world


def missing(step: int, inventories: list[Inventory], fence: dict[str, Any] | None) -> str | None:
    """Why ``step`` is not complete across the nodes' inventories, or None when it is."""
    markers = [inv[step].marker for inv in inventories if step in inv and inv[step].marker]
    if not markers:
        return "no node holds a valid commit marker"
    marker = markers[0]
    if superseded(marker, fence):
        return f"committed by the superseded attempt {marker['attempt']}"
    for rel, entry in marker["files"].items():
        if _holder(rel, entry["size"], step, inventories) is None:
            return f"{rel} is missing on its writer's node and on its peer's"
    return None


def _holder(rel: str, size: int, step: int, inventories: list[Inventory]) -> int | None:
    for rank, inv in enumerate(inventories):
        if step in inv and inv[step].files.get(rel) == size:
            return rank
    return None


def latest_fast(inventories: list[Inventory], fence: dict[str, Any] | None) -> FastPlan | None:
    """The newest step complete across the nodes (newer incomplete ones skipped, logged)."""
    steps = sorted({step for inv in inventories for step in inv}, reverse=True)
    for step in steps:
        reason = missing(step, inventories, fence)
        if reason is not None:
            log.warning("fast checkpoint %s skipped: %s", step_name(step), reason)
            continue
        marker = next(inv[step].marker for inv in inventories if step in inv and inv[step].marker)
        sources = {
            rel: _holder(rel, entry["size"], step, inventories)
            for rel, entry in marker["files"].items()
        }
        return FastPlan(step=step, marker=marker, sources=sources)
    return None


def newest_tier(persistent: int | None, fast: int | None) -> str | None:
    """Which tier a restart resumes from: the newer step; the persistent tier on a tie."""
    if persistent is None and fast is None:
        return None
    if fast is None or (persistent is not None and persistent >= fast):
        return "persistent"
    return "fast"


class NodeTier:
    """One node's fast-tier directory, as one rank sees it (several ranks may share it)."""

    def __init__(self, root: str | Path) -> None:
        self.storage = FilesystemStorage(root)

    def inventory(self) -> Inventory:
        """Every step this node holds anything of."""
        store = self.storage
        return {s: Held(store.read_marker(s), store.list_files(s)) for s in store.list_steps()}

    def read(self, step: int, rels: list[str]) -> dict[str, bytes]:
        """The bytes of files held here (to send to the peer or to a resuming rank)."""
        base = self.storage.local_dir(step)
        return {rel: (base / rel).read_bytes() for rel in rels}

    def keep(self, step: int, files: dict[str, bytes]) -> None:
        """Store files another rank sent (a peer copy, or a resume's missing share)."""
        for rel, data in files.items():
            self.storage.write_bytes(step, rel, data)

    def commit(self, step: int, marker: bytes) -> None:
        """Write this node's copy of the marker (identical bytes on every node: atomic
        replace, so ranks sharing the node may all write it)."""
        self.storage.write_bytes(step, MARKER, marker)

    def retain(self, keep_last: int, fence: dict[str, Any] | None) -> list[int]:
        """Drop all but the newest ``keep_last`` committed steps here (and the resume step)."""
        steps = self.storage.list_steps()
        complete = [s for s in steps if self.storage.read_marker(s) is not None]
        doomed = doomed_steps(steps, complete, keep_last=keep_last, fence=fence)
        for s in doomed:
            self.storage.delete_step(s)
        return doomed
