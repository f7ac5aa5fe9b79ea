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
process group, :mod:`.collectives`). The work is done by collaborators: :mod:`.writer` (the
background write, upload, commit and retention), :mod:`.reader` (which step to resume, checksum
verification, loading) and :mod:`.ownership` (fencing by restart attempt, the job's ownership).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from omni_trainer.checkpoint.async_save import BackgroundSaver, make_planner
from omni_trainer.checkpoint.collectives import CheckpointGroup
from omni_trainer.checkpoint.config import FAST, PERSISTENT, CheckpointConfig
from omni_trainer.checkpoint.fast_io import FastTierIO
from omni_trainer.checkpoint.fast_tier import NodeTier
from omni_trainer.checkpoint.loader_state import PER_RANK, SHARED, snapshot
from omni_trainer.checkpoint.owner import JobIdentity
from omni_trainer.checkpoint.ownership import RootOwnership
from omni_trainer.checkpoint.reader import CheckpointReader, Resume
from omni_trainer.checkpoint.state import ModelState, staged_state_dict
from omni_trainer.checkpoint.storage import CheckpointStorage, open_storage, step_name
from omni_trainer.checkpoint.writer import CheckpointWriter, SaveResult

log = logging.getLogger(__name__)


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
        self._storage = storage or open_storage(config.path)
        ranks = CheckpointGroup(group)
        env_local = os.environ.get("LOCAL_WORLD_SIZE")
        fast_dir = (fast_root or config.fast.path) if config.fast else None
        self.fast = None
        if fast_dir is not None:
            planner = make_planner(cache_plans=cache_plans, key=f"omni-fast-{id(self)}")
            self.fast = FastTierIO(
                NodeTier(fast_dir),
                group=ranks.group,
                rank=ranks.rank,
                world=ranks.world,
                local_world=local_world or (int(env_local) if env_local else ranks.world),
                planner=planner,
            )
        tag = hashlib.sha256(self._storage.url.encode()).hexdigest()[:12]
        scratch = Path(config.staging_dir or tempfile.gettempdir())
        scratch = scratch / f"omni-ckpt-{tag}" / f"rank-{ranks.rank:05d}"
        self.ownership = RootOwnership.resolve(self._storage, attempt=attempt, owner=owner)
        self._rank = ranks.rank
        self._loader_scope = loader_scope
        self._writer = CheckpointWriter(
            config=config,
            storage=self._storage,
            ranks=ranks,
            ownership=self.ownership,
            layout=dict(layout or {}),
            loader_scope=loader_scope,
            scratch=scratch,
            planner=make_planner(cache_plans=cache_plans, key=f"omni-ckpt-{tag}-{id(self)}"),
            fast=self.fast,
        )
        self._reader = CheckpointReader(
            storage=self._storage,
            ranks=ranks,
            ownership=self.ownership,
            scratch=scratch,
            fast=self.fast,
        )
        self._saver = BackgroundSaver()
        self._submitted_at = 0.0
        self._last_sync: SaveResult | None = None

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
            self._loader_scope == PER_RANK or self._rank == 0
        )
        loader = snapshot(loader_state) if writes_loader else None
        blocking = time.perf_counter() - start
        write = self._writer.fast_tier if tier == FAST else self._writer.persistent
        if self.config.async_save:
            self._submitted_at = time.monotonic()
            self._saver.submit(write, step, staged, loader, blocking)
        else:
            self._last_sync = write(step, staged, loader, blocking)

    @property
    def storage(self) -> CheckpointStorage:
        """Where checkpoints go: fixed at construction (the writer and the reader share it)."""
        return self._storage

    @property
    def stuck(self) -> bool:
        """The save in flight waits on failing storage: a request of it failed and is being
        retried (the store is down, or refuses us); waiting for it would stop training."""
        since = self._storage.failing_since
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

    # -- loading ---------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest complete step in any tier (every rank gets the answer). A fenced
        writer first claims the storage for its attempt and records the step it resumes from.

        Raises:
            Fenced: on every rank, when a newer attempt already claimed the storage.
        """
        return self._reader.latest()[0]

    def load_latest(self, state: ModelState) -> Resume | None:
        """Load the newest checkpoint complete in either tier into ``state`` (any layout);
        None when there is none. Partial or corrupt newer checkpoints are skipped with a
        warning."""
        return self._reader.load_latest(state)

    def load(self, step: int, state: ModelState) -> Resume:
        """Load checkpoint ``step`` into this rank's parameters and optimizer state.

        Returns:
            The step, this rank's loader state (None if the checkpoint has none) and the layout
            the checkpoint was saved with.
        """
        return self._reader.load(step, state)
