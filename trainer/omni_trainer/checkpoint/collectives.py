"""The checkpoint's collectives, on a process group of its own over all ranks (never P2P).

Every rank calls each at the same point; a single process without a process group runs them
as the identity. Rank 0 coordinates: :meth:`CheckpointGroup.on_rank0` runs a decision there and
hands every rank its result, or the refusal (:class:`Fenced`, :class:`ForeignCheckpoint`) that
each rank then raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from omni_trainer.checkpoint.owner import ForeignCheckpoint
from omni_trainer.checkpoint.storage import Fenced
from omni_trainer.distributed import comm


class CheckpointGroup:
    """This rank's place in the checkpoint's process group.

    Args:
        group: the group over all ranks (default: a new gloo group, created here, so construct
            on every rank at the same point); its own group keeps a background thread's
            collectives apart from training's.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_initialized()
        if self.distributed and group is None:
            group = dist.new_group(backend="gloo")
        self.group = group
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1

    def barrier(self) -> None:
        if self.distributed:
            comm.barrier(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        return comm.all_gather_object(obj, group=self.group)

    def broadcast(self, obj: Any, *, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        return comm.broadcast_object(obj, src=src, group=self.group)

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result (or its Fenced or ForeignCheckpoint) on every rank."""
        found: tuple[Any, tuple[str, str] | None] = (None, None)
        if self.rank == 0:
            try:
                found = (fn(), None)
            except (Fenced, ForeignCheckpoint) as exc:
                found = (None, (type(exc).__name__, str(exc)))
        result, error = self.broadcast(found)
        if error is not None:
            raise {"Fenced": Fenced, "ForeignCheckpoint": ForeignCheckpoint}[error[0]](error[1])
        return result
