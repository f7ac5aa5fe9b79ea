"""The trainer's checkpoints (``checkpoint`` section): resume, ``initFrom``, periodic and
emergency saves, and the figures the operator reads, over a :class:`Checkpointer`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import PERSISTENT, CheckpointConfig
from omni_trainer.checkpoint.state import ModelState
from omni_trainer.checkpoint.writer import SaveResult
from omni_trainer.components.dataplane import DataPlane
from omni_trainer.components.metrics import MetricsSink
from omni_trainer.components.timing import PhaseTimer
from omni_trainer.distributed import comm
from omni_trainer.interop.runtime import find_checkpoint
from omni_trainer.mcore.parallel import ProcessGroups


class CheckpointSession:
    """Checkpoints of one run; with no ``checkpoint`` section it saves and resumes nothing.

    ``state`` builds this rank's :class:`ModelState` (a collective under ZeRO-1: every rank
    calls it together).
    """

    def __init__(
        self,
        cfg: CheckpointConfig | None,
        *,
        groups: ProcessGroups,
        state: Callable[[], ModelState],
        data: DataPlane,
        timer: PhaseTimer,
        metrics: MetricsSink,
    ) -> None:
        self.cfg, self.groups, self.state, self.data = cfg, groups, state, data
        self.timer, self.metrics = timer, metrics
        self.checkpointer = Checkpointer(cfg, layout=groups.dims.as_dict()) if cfg else None
        self.saved_step: int | None = None
        """The last step saved or loaded (None: none yet)."""
        self.saved_tier: str | None = None
        """The tier :attr:`saved_step` went to (None: loaded, or not saved yet)."""
        self.save_seconds = 0.0
        """The longest save so far, blocking and background (the stop decision budgets it)."""

    def start(self, *, resume: bool) -> int:
        """The step to start from: the latest complete checkpoint when resuming (if any), else
        0 after ``checkpoint.initFrom``'s weights (if set)."""
        step = self._resume() if resume and self.checkpointer else None
        if step is None:
            self._init_from()
            step = 0
        self.saved_step = step
        return step

    def _resume(self) -> int | None:
        found = self.checkpointer.load_latest(self.state())
        if found is None:
            return None
        self.data.load_state_dict(found.loader_state)
        return found.step

    def _init_from(self) -> None:
        """A fresh run starts from another checkpoint's weights only."""
        source = self.cfg.init_from if self.cfg else None
        if source is not None:
            root, step = find_checkpoint(source)
            weights = dataclasses.replace(self.state(), optimizer=None)
            Checkpointer(CheckpointConfig(path=root), cache_plans=False).load(step, weights)

    def due(self, step: int) -> bool:
        return self.checkpointer is not None and self.cfg.tier_due(step) is not None

    def save(self, step: int, *, periodic: bool = False, tier: str | None = None) -> None:
        """Asynchronous checkpoint after ``step`` completed steps, in the tier due then (the
        persistent one for an emergency save off the schedule); the loop waits for the host
        copy only. The loader state saved is every shard's, so any layout can resume it.

        A ``periodic`` save is skipped while the save before it waits on failing storage
        (:meth:`_skip`); an emergency save waits for it."""
        tier = tier or self.cfg.tier_due(step) or PERSISTENT
        if periodic and self._skip(step):
            return
        with self.timer.span("checkpoint_blocking"):
            previous = self.checkpointer.wait()  # save() would wait for it too; we report it
            everyone = comm.all_gather_object(self.data.state_dict(), group=self.groups.dp)
            shards = {k: v for state in everyone for k, v in state["shards"].items()}
            self.checkpointer.save(step, self.state(), {"shards": shards}, tier=tier)
            self.saved_step, self.saved_tier = step, tier
        self._report(previous)

    def finish(self, step: int) -> None:
        """The run's last step goes to the persistent tier unless it is there already (or was
        loaded from there), so what export and a later run see is the trained model whatever
        ``intervalSteps`` is; :meth:`close` then waits for it."""
        if self.checkpointer is None:
            return
        if self.saved_step != step or self.saved_tier not in (None, PERSISTENT):
            self.save(step, tier=PERSISTENT)

    def _skip(self, step: int) -> bool:
        """Skip this save, on every rank, if any rank's save in flight waits on failing storage:
        training goes on, and the next due save tries again (a storage outage would otherwise
        stop training at every due save for as long as the retries of the one before last).
        Agreed over all ranks first: a save is collective, so all take it or none."""
        stuck = torch.tensor([1.0 if self.checkpointer.stuck else 0.0])
        if comm.all_reduce(stuck, op="max").item() == 0.0:
            return False
        self.metrics.record_checkpoint_skipped(step)
        if self.groups.rank == 0:
            print(f"checkpoint after step {step} skipped: the save before it is retrying on "
                  f"failing storage ({self.checkpointer.storage.url})", flush=True)  # fmt: skip
        return True

    def poll(self) -> None:
        if self.checkpointer is not None:
            self._report(self.checkpointer.poll())

    def close(self) -> None:
        """Wait for the last save.

        Raises:
            RuntimeError: it failed (the run must not look complete).
        """
        if self.checkpointer:
            last = self.checkpointer.close()
            if last is not None and not last.committed:
                raise RuntimeError(f"the last checkpoint failed: {last.errors}")
            self._report(last)

    def _report(self, result: SaveResult | None) -> None:
        """Export a committed checkpoint (the operator reads it to refill the restart budget)."""
        if result is not None and result.committed:
            self.save_seconds = max(self.save_seconds, result.blocking_s + result.background_s)
            self.metrics.record_checkpoint(
                step=result.step,
                seconds=result.blocking_s + result.background_s,
                blocking_seconds=result.blocking_s,
            )
