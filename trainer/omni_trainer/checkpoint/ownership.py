"""Who may write a checkpoint root: this restart attempt and this job.

Fencing: a writer of a numbered attempt claims the root; once a newer attempt has claimed it,
the older can neither commit nor delete (:class:`~omni_trainer.checkpoint.storage.Fenced`).
Ownership: every marker records the job that wrote it, and a resume refuses another job's
checkpoint (:func:`~omni_trainer.checkpoint.owner.check_owner`) before it claims anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omni_trainer.checkpoint.owner import JobIdentity, check_owner
from omni_trainer.checkpoint.storage import CheckpointStorage, step_name


@dataclass(frozen=True)
class RootOwnership:
    """The attempt and job writing through ``storage``.

    Attributes:
        attempt: the restart attempt (``OMNI_RESTART_ATTEMPT``, which the operator sets);
            None (a local run): unfenced.
        owner: the job, recorded in markers (from the pod's environment; None in a local run).
    """

    storage: CheckpointStorage
    attempt: int | None
    owner: JobIdentity | None

    @classmethod
    def resolve(
        cls, storage: CheckpointStorage, *, attempt: int | None, owner: JobIdentity | None
    ) -> RootOwnership:
        """The given attempt and owner, each defaulting to the pod's environment."""
        env = os.environ.get("OMNI_RESTART_ATTEMPT")
        return cls(
            storage,
            attempt=attempt if attempt is not None else int(env) if env else None,
            owner=owner if owner is not None else JobIdentity.from_env(),
        )

    def claim(self) -> None:
        """Claim the root for this attempt (a fenced writer only)."""
        if self.attempt is not None:
            self.storage.claim(self.attempt)

    def claim_once(self) -> None:
        """Claim the root unless this writer already holds it (a run that did not resume)."""
        if self.attempt is not None and self.storage.attempt is None:
            self.storage.claim(self.attempt)

    def marker_extra(self, loader_scope: str) -> dict[str, Any]:
        """What a commit marker records besides files and layout: the loader scope, the job."""
        owner = {"owner": self.owner.as_dict()} if self.owner is not None else {}
        return {"loader": loader_scope, **owner}

    def check_marker(self, marker: dict[str, Any], *, step: str) -> None:
        """Raises ForeignCheckpoint when ``marker`` (of ``step``) records another job."""
        check_owner(marker, self.owner, root=self.storage.url, step=step)

    def check_step(self, step: int | None) -> None:
        """As :meth:`check_marker`, for the committed marker of ``step`` (None: nothing)."""
        marker = self.storage.read_marker(step) if step is not None else None
        if marker is not None:
            self.check_marker(marker, step=step_name(step))
