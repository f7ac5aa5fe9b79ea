"""The trainer's entry point: ``Checkpointer.save`` (async), ``wait``, ``load_latest``.

Integration sketch (the training loop, after ``train_step(step)`` completed ``step + 1`` steps)::

    ckpt = Checkpointer(cfg.checkpoint, layout=dims.as_dict())        # on every rank
    resume = ckpt.load_latest(ModelState.from_trainer(trainer))      # None: fresh start
    start = 0 if resume is None else resume.step
    if resume: trainer.stream.load_state_dict(resume.loader_state)
    for step in range(start, steps):
        trainer.train_step(step)
        if cfg.checkpoint.due(step + 1):
            ckpt.save(step + 1, ModelState.from_trainer(trainer), trainer.stream.state_dict())
    ckpt.close()                                                      # waits for the last save

Every rank calls every method at the same steps (they run collectives on the checkpoint's own
process group).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from omni_trainer.checkpoint.async_save import BackgroundSaver, make_planner, write_share
from omni_trainer.checkpoint.config import FAST, PERSISTENT, CheckpointConfig
from omni_trainer.checkpoint.fast_io import FastTierIO, MarkerInfo
from omni_trainer.checkpoint.fast_tier import FastPlan, NodeTier, latest_fast, newest_tier
from omni_trainer.checkpoint.loader_state import (
    PER_RANK,
    SHARED,
    deserialize,
    file_for,
    snapshot,
)
from omni_trainer.checkpoint.owner import ForeignCheckpoint, JobIdentity, check_owner
from omni_trainer.checkpoint.state import ModelState, load_targets, staged_state_dict
from omni_trainer.checkpoint.storage import (
    CheckpointStorage,
    Fenced,
    FileEntry,
    open_storage,
    step_name,
)
from omni_trainer.checkpoint.verify import mismatches, share
from omni_trainer.distributed import comm

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


@dataclass(frozen=True)
class Resume:
    """Where a restart continues: ``step`` optimizer steps done, the loader state of then."""

    step: int
    loader_state: Any | None
    layout: dict[str, Any]


class Checkpointer:
    """Asynchronous, resharding checkpoints of model, optimizer and loader state.

    Args:
        config: the manifest's ``checkpoint`` section.
        storage: where to store (default: from ``config.path``).
        group: process group over ALL ranks for checkpoint collectives (rank 0 coordinates);
            default: a new gloo group, created here (so construct on every rank at the same
            point). Its own group keeps the background thread's collectives apart from training.
        layout: the parallel layout, recorded in the commit marker (informational: loading
            works into any layout).
        loader_scope: ``"shared"`` (every rank's loader state is identical: rank 0 writes it)
            or ``"per_rank"`` (each rank writes its own).
        cache_plans: reuse DCP save plans while the state's structure is unchanged.
        attempt: the restart attempt writing (fencing: once a newer attempt resumed, this one
            can neither commit nor delete); default ``OMNI_RESTART_ATTEMPT``, which the
            operator sets; None (a local run): unfenced.
        fast_root: this rank's node-local directory of the fast tier, with ``config.fast``
            (default: its ``path``; tests simulating several nodes on one host pass their own).
        local_world: ranks per node (default ``LOCAL_WORLD_SIZE``, which torchrun sets; ranks
            are numbered node by node): rank r's fast-tier copy goes to rank r + local_world.
        owner: the job writing, recorded in markers; a resume refuses another job's
            checkpoint (default: from the pod's environment; None in a local run).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        storage: CheckpointStorage | None = None,
        group: dist.ProcessGroup | None = None,
        layout: dict[str, Any] | None = None,
        loader_scope: str = SHARED,
        cache_plans: bool = True,
        attempt: int | None = None,
        fast_root: str | Path | None = None,
        local_world: int | None = None,
        owner: JobIdentity | None = None,
    ) -> None:
        if loader_scope not in (SHARED, PER_RANK):
            raise ValueError(f"loader_scope must be {SHARED!r} or {PER_RANK!r}")
        self.config = config
        self.storage = storage or open_storage(config.path)
        self.distributed = dist.is_initialized()
        if self.distributed and group is None:
            group = dist.new_group(backend="gloo")
        self.group = group
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        env_local = os.environ.get("LOCAL_WORLD_SIZE")
        self.local_world = local_world or (int(env_local) if env_local else self.world)
        fast_dir = (fast_root or config.fast.path) if config.fast else None
        self.fast = None
        if fast_dir is not None:
            planner = make_planner(cache_plans=cache_plans, key=f"omni-fast-{id(self)}")
            self.fast = FastTierIO(
                NodeTier(fast_dir),
                group=self.group,
                rank=self.rank,
                world=self.world,
                local_world=self.local_world,
                planner=planner,
            )
        self.layout = dict(layout or {})
        self.loader_scope = loader_scope
        tag = hashlib.sha256(self.storage.url.encode()).hexdigest()[:12]
        scratch = Path(config.staging_dir or tempfile.gettempdir())
        self.scratch = scratch / f"omni-ckpt-{tag}" / f"rank-{self.rank:05d}"
        self.planner = make_planner(cache_plans=cache_plans, key=f"omni-ckpt-{tag}-{id(self)}")
        self._saver = BackgroundSaver()
        self._submitted_at = 0.0
        self._last_sync: SaveResult | None = None
        env = os.environ.get("OMNI_RESTART_ATTEMPT")
        self.attempt = attempt if attempt is not None else int(env) if env else None
        self.owner = owner if owner is not None else JobIdentity.from_env()

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: ModelState | Callable[[], ModelState],
        loader_state: Any | None = None,
        *,
        tier: str = PERSISTENT,
    ) -> None:
        """Checkpoint ``step`` (optimizer steps completed) on every rank, in ``tier``
        (``"persistent"`` or ``"fast"``, the latter only with ``checkpoint.fast``).

        Blocks for the previous save to finish, then for the host copy of this rank's share and
        the loader snapshot only; the rest runs in the background (unless ``async`` is off).
        """
        if tier == FAST and self.fast is None:
            raise ValueError("a fast-tier save needs checkpoint.fast")
        previous = self._saver.wait()
        if previous is not None and not previous.committed:
            log.error("checkpoint %s not committed: %s", step_name(previous.step), previous.errors)
        start = time.perf_counter()
        model_state = state() if callable(state) else state
        staged = staged_state_dict(model_state)
        writes_loader = loader_state is not None and (
            self.loader_scope == PER_RANK or self.rank == 0
        )
        loader = snapshot(loader_state) if writes_loader else None
        blocking = time.perf_counter() - start
        write = self._write_fast if tier == FAST else self._write
        if self.config.async_save:
            self._submitted_at = time.monotonic()
            self._saver.submit(write, step, staged, loader, blocking)
        else:
            self._last_sync = write(step, staged, loader, blocking)

    @property
    def stuck(self) -> bool:
        """The save in flight waits on failing storage: a request of it failed and is being
        retried (the store is down, or refuses us); waiting for it would stop training."""
        since = self.storage.failing_since
        return self._saver.busy and since is not None and since >= self._submitted_at

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight; its result (None when there was none)."""
        if not self.config.async_save:
            result, self._last_sync = self._last_sync, None
            return result
        return self._saver.wait()

    def poll(self) -> SaveResult | None:
        """The save that finished since the last look, once (None while one runs or none
        did): lets the loop report a committed checkpoint as soon as it is, not at the next."""
        if not self.config.async_save:
            return self.wait()
        return self._saver.poll()

    def close(self) -> SaveResult | None:
        """Finish the last save and stop the background thread."""
        result = self.wait()
        self._saver.close()
        return result

    def _write(
        self, step: int, staged: dict[str, Any], loader: Any | None, blocking: float
    ) -> SaveResult:
        """Background part: DCP write, loader state, upload, then the commit on rank 0.

        Every rank runs the same collectives whatever fails where (the store down for one rank
        and not another): rank 0's preparation is agreed on before DCP's collective write,
        which all ranks then run or all skip; each rank's failure is gathered at the end."""
        start = time.perf_counter()
        storage = self.storage
        files: dict[str, FileEntry] = {}
        error: str | None = None
        local = storage.local_dir(step) or self.scratch / step_name(step)
        try:
            self._claim_once()
            if self.rank == 0 and step in storage.list_steps():
                storage.remove(step)  # a partial save of this step from a crashed run
        except Exception as exc:
            error = self._failed(step, exc)
        prepared = [e for e in self._all_gather(error) if e is not None]
        if prepared and error is None:
            error = f"rank {self.rank}: not written: {prepared[0]}"
        try:
            if not prepared:
                files = write_share(storage, step, staged, loader, local=local, rank=self.rank,
                                    planner=self.planner, group=self.group)  # fmt: skip
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
        reports = self._all_gather((files, error))
        errors = [e for _, e in reports if e is not None]
        committed = False
        if self.rank == 0 and not errors:
            try:
                merged = {rel: entry for part, _ in reports for rel, entry in part.items()}
                storage.commit(step, merged, layout=self.layout, extra=self._marker_extra())
                committed = True
                storage.retain(self.config.keep_last)
            except Exception as exc:
                log.exception("checkpoint %s: commit or retention failed", step_name(step))
                errors.append(f"rank 0: {type(exc).__name__}: {exc}")
        committed = self._broadcast(committed)
        return SaveResult(
            step=step,
            committed=committed,
            blocking_s=blocking,
            background_s=time.perf_counter() - start,
            errors=errors,
        )

    def _marker_extra(self) -> dict[str, Any]:
        """What a commit marker records besides files and layout: the loader scope, the job."""
        owner = {"owner": self.owner.as_dict()} if self.owner is not None else {}
        return {"loader": self.loader_scope, **owner}

    def _failed(self, step: int, exc: Exception) -> str:
        log.exception("rank %d: checkpoint %s failed", self.rank, step_name(step))
        return f"rank {self.rank}: {type(exc).__name__}: {exc}"

    def _claim_once(self) -> None:
        """Rank 0 claims the persistent root for its attempt (a run that did not resume)."""
        if self.rank == 0 and self.attempt is not None and self.storage.attempt is None:
            self.storage.claim(self.attempt)

    def _write_fast(
        self, step: int, staged: dict[str, Any], loader: Any | None, blocking: float
    ) -> SaveResult:
        """Background part of a fast-tier save (see :meth:`FastTierIO.write`)."""
        start = time.perf_counter()
        try:
            self._claim_once()
        except Exception as exc:  # Fenced: FastTierIO's fence check refuses the commit too
            log.error("fast checkpoint %s: claim failed: %s", step_name(step), exc)
        info = MarkerInfo(self.layout, {**self._marker_extra(), "tier": FAST})
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

    # -- loading ---------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest complete step in any tier (every rank gets the answer). A fenced
        writer first claims the storage for its attempt and records the step it resumes from.

        Raises:
            Fenced: on every rank, when a newer attempt already claimed the storage.
        """
        return self._latest()[0]

    def _latest(self) -> tuple[int | None, FastPlan | None]:
        """The newest step complete in either tier whose checksums verify, and the fast-tier
        plan when it wins; a persistent step that fails verification is skipped for the one
        before it (every rank takes part in verifying, and gets the same answer).

        Raises:
            Fenced: on every rank, when a newer attempt already claimed the storage.
            ForeignCheckpoint: on every rank, when the checkpoint belongs to another job.
        """
        inventories = self._all_gather(self.fast.node.inventory()) if self.fast else []
        skip: list[int] = []
        while True:
            step, plan = self._select(inventories, skip)
            if step is None or plan is not None or not (bad := self._verify(step)):
                break
            if self.rank == 0:
                where = f"{self.storage.url}/{step_name(step)}"
                log.warning("checkpoint %s skipped (checksums), falling back to the previous "
                            "committed step: %s", where, "; ".join(bad))  # fmt: skip
            skip.append(step)
        self._on_rank0(lambda: self.storage.resumed_from(step))
        return step, plan

    def _select(
        self, inventories: list[Any], skip: list[int]
    ) -> tuple[int | None, FastPlan | None]:
        """Rank 0's choice (owner checked, the root claimed), broadcast to every rank."""

        def choose() -> tuple[int | None, FastPlan | None]:
            newest = next(iter(reversed(self.storage.list_steps())), None)
            self._check_owner(newest)  # before the claim: never fence another job's root
            if self.attempt is not None:
                self.storage.claim(self.attempt)
            persistent = self.storage.latest_complete(skip)
            plan = latest_fast(inventories, self.storage.read_fence()) if self.fast else None
            if newest_tier(persistent, plan.step if plan else None) == FAST:
                where = f"{step_name(plan.step)} (fast tier)"
                check_owner(plan.marker, self.owner, root=self.storage.url, step=where)
                return plan.step, plan
            self._check_owner(persistent)
            return persistent, None

        return self._on_rank0(choose)

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result (or its Fenced or ForeignCheckpoint) on every rank."""
        found: tuple[Any, tuple[str, str] | None] = (None, None)
        if self.rank == 0:
            try:
                found = (fn(), None)
            except (Fenced, ForeignCheckpoint) as exc:
                found = (None, (type(exc).__name__, str(exc)))
        result, error = self._broadcast(found)
        if error is not None:
            raise {"Fenced": Fenced, "ForeignCheckpoint": ForeignCheckpoint}[error[0]](error[1])
        return result

    def _check_owner(self, step: int | None) -> None:
        marker = self.storage.read_marker(step) if step is not None else None
        if marker is not None:
            check_owner(marker, self.owner, root=self.storage.url, step=step_name(step))

    def _verify(self, step: int) -> list[str]:
        """The files of ``step`` whose sha256 differs from its marker's (every rank hashes its
        share, streamed, in threads; all get the whole list)."""
        marker = self._broadcast(self.storage.read_marker(step) if self.rank == 0 else None)
        files = (marker or {}).get("files") or {}
        mine = share(files, self.rank, self.world)
        bad = mismatches(partial(self.storage.open_file, step), files, mine)
        return sorted(m for part in self._all_gather(bad) for m in part)

    def load_latest(self, state: ModelState) -> Resume | None:
        """Load the newest checkpoint complete in either tier into ``state`` (any layout);
        None when there is none. Partial or corrupt newer checkpoints are skipped with a
        warning."""
        step, plan = self._latest()
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
        """Load checkpoint ``step`` into this rank's parameters and optimizer state.

        Returns:
            The step, this rank's loader state (None if the checkpoint has none) and the layout
            the checkpoint was saved with.
        """
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
                process_group=self.group,
                no_dist=not self.distributed,
            )
            apply()
            loader = None
            rel = file_for(self.rank, marker.get("loader", SHARED))
            if rel in marker["files"]:
                raw = read(rel)
                loader = None if raw is None else deserialize(raw)
        finally:
            shutil.rmtree(cleanup, ignore_errors=True)
        self._barrier()
        return Resume(step=marker["step"], loader_state=loader, layout=marker.get("layout", {}))

    # -- collectives on the checkpoint group (never P2P) -------------------------------------
    def _barrier(self) -> None:
        if self.distributed:
            comm.barrier(self.group)

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        return comm.all_gather_object(obj, group=self.group)

    def _broadcast(self, obj: Any, *, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        return comm.broadcast_object(obj, src=src, group=self.group)
