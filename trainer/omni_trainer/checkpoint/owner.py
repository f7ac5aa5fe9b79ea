"""The job a checkpoint belongs to: recorded in every commit marker, checked before a resume.

Two jobs sharing one ``checkpoint.path`` would otherwise continue each other's runs: a
compatible one silently, an incompatible one with a confusing load error. The operator passes
the job's identity to its pods (:data:`JOB_ENV`); the commit marker records it under
``owner``; a resume of a checkpoint whose owner is another job (namespace and name) is refused
with the owner and the fix. The UID is recorded to tell a re-created job of the same name in
messages, not to refuse it: deleting and re-applying a job resumes its own checkpoints. Local
runs (no identity) and checkpoints without an owner are never refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

JOB_NAMESPACE_ENV = "OMNI_JOB_NAMESPACE"
JOB_NAME_ENV = "OMNI_JOB_NAME"
JOB_UID_ENV = "OMNI_JOB_UID"
JOB_ENV = (JOB_NAMESPACE_ENV, JOB_NAME_ENV, JOB_UID_ENV)
"""The environment that names the job a trainer pod belongs to (set by the operator)."""


class ForeignCheckpoint(RuntimeError):
    """The checkpoint to resume belongs to another job."""


@dataclass(frozen=True)
class JobIdentity:
    """Namespace, name and UID of the job that writes (or resumes) a checkpoint."""

    namespace: str
    name: str
    uid: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobIdentity | None:
        """The pod's job, or None outside a job (a local run)."""
        env = os.environ if env is None else env
        name = env.get(JOB_NAME_ENV)
        if not name:
            return None
        return cls(env.get(JOB_NAMESPACE_ENV, ""), name, env.get(JOB_UID_ENV, ""))

    @classmethod
    def from_marker(cls, marker: Mapping[str, Any]) -> JobIdentity | None:
        """The owner a commit marker records, or None (a local run's, or an older format)."""
        owner = marker.get("owner")
        if not isinstance(owner, Mapping) or not owner.get("name"):
            return None
        return cls(str(owner.get("namespace", "")), str(owner["name"]), str(owner.get("uid", "")))

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def describe(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""
        return f"{where}{self.name}" + (f" (uid {self.uid})" if self.uid else "")

    def same_job(self, other: JobIdentity) -> bool:
        return (self.namespace, self.name) == (other.namespace, other.name)


def check_owner(marker: Mapping[str, Any], me: JobIdentity | None, *, root: str, step: str) -> None:
    """Refuse to resume ``step`` (its directory name) of the checkpoints under ``root`` when
    its marker's owner is another job.

    Raises:
        ForeignCheckpoint: naming the owner and the two fixes.
    """
    owner = JobIdentity.from_marker(marker)
    if me is None or owner is None or owner.same_job(me):
        return
    raise ForeignCheckpoint(
        f"checkpoint {root}/{step} belongs to job {owner.describe()}, not to this job "
        f"{me.describe()}: jobs never resume each other's checkpoints. To start from its "
        f"weights, set checkpoint.initFrom: {root} and a checkpoint.path of this job's own; "
        "otherwise choose a new checkpoint.path"
    )
