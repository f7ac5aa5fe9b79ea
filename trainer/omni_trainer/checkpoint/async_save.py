"""Asynchronous saves: one background thread, one save in flight, DCP with cached plans.

The training loop blocks only for the host copy (``state.staged_state_dict``) and the loader
snapshot; DCP planning, writing, hashing, upload and the commit run on a worker thread. The
worker's collectives (DCP's gather/scatter/broadcast, our all_gather of file lists) run on a
process group of their own, created up front on every rank, so they can never interleave with
the training loop's collectives on the main thread. No send/recv (P2P) is used anywhere here.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from omni_trainer.checkpoint.loader_state import loader_file, serialize
from omni_trainer.checkpoint.storage import CheckpointStorage, FileEntry, describe_file

log = logging.getLogger(__name__)
T = TypeVar("T")


class RecordingWriter(FileSystemWriter):
    """``FileSystemWriter`` that remembers which files this rank wrote (for the commit list)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
        self.written: set[str] = set()

    def write_data(self, plan: Any, planner: Any) -> cf.Future:
        future = super().write_data(plan, planner)
        return _chain(future, self._record)

    def _record(self, results: list[Any]) -> list[Any]:
        self.written.update(r.storage_data.relative_path for r in results)
        return results


def _chain(future: Any, fn: Callable[[Any], Any]) -> Any:
    """``future`` mapped through ``fn`` (torch's writer returns a ``torch.futures.Future``)."""
    return future.then(lambda f: fn(f.wait()))


def make_planner(*, cache_plans: bool, key: str) -> DefaultSavePlanner:
    """A save planner; with ``cache_plans`` the local and global plans and the metadata are
    reused while the state's structure is unchanged (first save pays planning, later ones not).

    ``key`` names this checkpointer's plan cache: torch keys it by class name by default, so two
    checkpointers in one process would otherwise share (and confuse) cached plans.
    """
    planner = DefaultSavePlanner(enable_plan_caching=cache_plans)
    planner._cached_plans_key = key
    return planner


def save_dcp(
    state_dict: dict[str, Any],
    directory: Path,
    *,
    planner: DefaultSavePlanner,
    group: dist.ProcessGroup | None,
) -> list[str]:
    """Write ``state_dict`` with torch DCP into ``directory`` (collective over ``group``).

    Returns:
        The files (relative to ``directory``) this rank wrote, ``.metadata`` on the coordinator.
    """
    directory.mkdir(parents=True, exist_ok=True)
    writer = RecordingWriter(directory)
    use_dist = dist.is_initialized()
    dcp.save(
        state_dict,
        storage_writer=writer,
        planner=planner,
        process_group=group,
        no_dist=not use_dist,
    )
    files = sorted(writer.written)
    coordinator = not use_dist or dist.get_rank(group) == 0
    if coordinator:
        files.append(".metadata")
    return files


class BackgroundSaver:
    """One worker thread; :meth:`submit` waits for the previous job first (one in flight)."""

    def __init__(self, name: str = "omni-ckpt") -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._future: cf.Future | None = None

    @property
    def busy(self) -> bool:
        """A job is still running."""
        return self._future is not None and not self._future.done()

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` in the background after the previous job finished."""
        self.wait()
        self._future = self._pool.submit(fn, *args)
        return self._future

    def poll(self) -> Any:
        """The finished job's result, once (None while it runs or when idle)."""
        return self.wait() if self._future is not None and self._future.done() else None

    def wait(self) -> Any:
        """Block until the job in flight is done; returns its result (None when idle)."""
        future, self._future = self._future, None
        return None if future is None else future.result()

    def close(self) -> None:
        """Finish the job in flight and stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def write_share(
    storage: CheckpointStorage,
    step: int,
    staged: dict[str, Any],
    loader: Any,
    *,
    local: Path,
    rank: int,
    planner: DefaultSavePlanner,
    group: dist.ProcessGroup | None,
) -> dict[str, FileEntry]:
    """This rank's share of a checkpoint: its DCP files under ``local/model`` and its loader
    state in ``storage``; the files it wrote, with their sizes (either tier's marker lists them)."""
    files: dict[str, FileEntry] = {}
    for rel in save_dcp(staged, local / "model", planner=planner, group=group):
        files[f"model/{rel}"] = describe_file(local / "model" / rel)
    if loader is not None:
        data = serialize(loader)
        rel = loader_file(rank)
        storage.write_bytes(step, rel, data)
        files[rel] = FileEntry(len(data), hashlib.sha256(data).hexdigest())
    return files
