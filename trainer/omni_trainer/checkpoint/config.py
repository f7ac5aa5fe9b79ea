"""The ``checkpoint`` section of the job manifest (torch-free: the operator imports it)."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from omni_trainer.config_base import Spec
from omni_trainer.path_rules import path_problem


class FastTierConfig(Spec):
    """The fast checkpoint tier: frequent saves on each node's local disk plus a copy on a
    peer node, so a lost node's share survives on its peer (the persistent tier stays the
    ``checkpoint.path`` one, saved less often)."""

    path: str = Field(
        description="an absolute directory on each node's local disk; pods mount it from a "
        "hostPath (DirectoryOrCreate), not an emptyDir: an emptyDir dies with its pod, and a "
        "node loss recreates every pod of the gang, so the survivors' copies would die too"
    )
    interval_steps: int = Field(
        ge=1,
        description="save to the fast tier after every N optimizer steps (smaller than "
        "checkpoint.intervalSteps; a step due in both tiers goes to the persistent one)",
    )
    keep_last: int = Field(2, ge=1, description="fast-tier steps each node keeps")

    @field_validator("path")
    @classmethod
    def _local_dir(cls, path: str) -> str:
        if path.startswith("s3://") or not path.startswith("/"):
            raise ValueError(
                f"{path!r} must be an absolute node-local directory (e.g. "
                "/var/lib/omni/fast); S3 or a shared PVC belongs in checkpoint.path"
            )
        if (problem := path_problem(path)) is not None:
            raise ValueError(problem)
        return path


class CheckpointConfig(Spec):
    """Where, how often and how many checkpoints a job keeps."""

    path: str = Field(
        description="a directory (a PVC mount in pods) or s3://bucket/prefix; credentials for S3 "
        "come from the standard AWS chain (env from a Secret, IRSA, instance profile)"
    )
    interval_steps: int = Field(100, ge=1, description="save after every N optimizer steps")
    keep_last: int = Field(3, ge=1, description="complete checkpoints kept; older ones deleted")
    async_save: bool = Field(
        True,
        alias="async",
        description="write/upload in the background; the loop only waits for the host copy",
    )
    init_from: str | None = Field(
        None,
        description="a checkpoint (root or step-NNNNNNNN directory) whose model weights a fresh "
        "run starts from; optimizer and loader state are not taken (e.g. LLaVA's stage 2 "
        "starting from stage 1); a run resuming its own checkpoint ignores it",
    )
    staging_dir: str | None = Field(
        None,
        description="node-local scratch where S3 checkpoints are written before upload and "
        "downloaded before load; default: the system temp dir",
    )

    fast: FastTierConfig | None = Field(
        None,
        description="a fast tier saved more often on node-local disks, each share copied to a "
        "peer node; a restart resumes from the newest step complete in either tier",
    )

    @field_validator("path", "init_from", "staging_dir")
    @classmethod
    def _no_escape(cls, path: str | None, info: ValidationInfo) -> str | None:
        # initFrom only reads: a system directory there is odd but harmless
        local = info.field_name != "init_from" and path is not None and not path.startswith("s3:")
        if path is not None and (problem := path_problem(path, local=local)) is not None:
            raise ValueError(problem)
        return path

    @model_validator(mode="after")
    def _fast_more_often(self) -> CheckpointConfig:
        if self.fast is not None and self.fast.interval_steps >= self.interval_steps:
            raise ValueError(
                f"fast.intervalSteps ({self.fast.interval_steps}) must be smaller than "
                f"intervalSteps ({self.interval_steps}): the fast tier saves more often than "
                "the persistent one; lower fast.intervalSteps or raise intervalSteps"
            )
        return self

    def is_s3(self) -> bool:
        """True when :attr:`path` names an S3 location."""
        return self.path.startswith("s3://")

    def due(self, step: int) -> bool:
        """Whether the checkpoint after ``step`` completed optimizer steps is due."""
        return step > 0 and step % self.interval_steps == 0

    def tier_due(self, step: int) -> str | None:
        """The tier whose save is due after ``step`` steps: ``"persistent"``, ``"fast"`` or
        None (the persistent tier wins a step due in both)."""
        if self.due(step):
            return PERSISTENT
        if self.fast is not None and step > 0 and step % self.fast.interval_steps == 0:
            return FAST
        return None


PERSISTENT, FAST = "persistent", "fast"
