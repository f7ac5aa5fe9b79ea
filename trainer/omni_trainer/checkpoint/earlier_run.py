"""What a local run and an export find under ``checkpoint.path`` before they start: an earlier
run's steps a fresh run would overwrite, or no checkpoint at all where trained weights are
expected. Each answer is the message to print, naming the fix (torch-free)."""

from __future__ import annotations

from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.storage import open_storage, step_name


def earlier_run(cfg: CheckpointConfig | None) -> str | None:
    """Why a fresh run must not start on ``cfg.path`` (it holds an earlier run's steps, which
    the new run's saves and retention would replace), or None when the path is empty.

    Pods never ask: the operator starts every attempt with ``--resume auto``."""
    if cfg is None:
        return None
    steps = open_storage(cfg.path).list_steps()
    if not steps:
        return None
    held = ", ".join(step_name(s) for s in steps[-3:])
    more = f" and {len(steps) - 3} more" if len(steps) > 3 else ""
    return (
        f"checkpoint.path {cfg.path} holds an earlier run's checkpoints ({held}{more}): pass "
        "--resume auto to continue that run, or set checkpoint.path to another directory "
        "(--resume none starts fresh and overwrites them)"
    )


def no_checkpoint(cfg: CheckpointConfig | None) -> str:
    """The message of an export or generation that found no trained weights to read."""
    where = (
        f"no complete checkpoint under checkpoint.path {cfg.path}"
        if cfg is not None
        else "the job has no checkpoint section"
    )
    return (
        f"{where}: train first (the last step is always saved), pass --checkpoint with a "
        "checkpoint root or step-NNNNNNNN directory, or --initial-weights to write the "
        "untrained weights the job starts from"
    )
