"""The ``checkpoint`` section of the job manifest (torch-free: the operator imports it)."""

from __future__ import annotations

from pydantic import Field

from omni_trainer.config_base import Spec


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

    def is_s3(self) -> bool:
        """True when :attr:`path` names an S3 location."""
        return self.path.startswith("s3://")

    def due(self, step: int) -> bool:
        """Whether the checkpoint after ``step`` completed optimizer steps is due."""
        return step > 0 and step % self.interval_steps == 0
