"""Reachability before the gang trains: every data source opens and the checkpoint storage
answers with this process's credentials, or the problem names the field, the location and the
cause (``omni validate --sources``; ``omni train`` runs it once per pod before the process group
forms, so the cause lands in the pod's termination message and the job's status)."""

from __future__ import annotations

from omni_trainer.config import TrainerConfig
from omni_trainer.data.config import ShardSourceConfig

_CREDENTIALS = (
    "S3 credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY from a Secret, AWS_PROFILE, a web identity or instance role) and none "
    "was found"
)


def source_problems(cfg: TrainerConfig) -> list[str]:
    """Every shard source that cannot be listed or read, and a checkpoint storage that cannot
    be listed, as ``spec.trainer.<field> (<location>): <ExceptionType>: <message>``."""
    from omni_trainer.checkpoint.storage import open_storage
    from omni_trainer.data.shards import ShardSource

    out: list[str] = []
    for i, src in enumerate(cfg.data.sources):
        if not isinstance(src, ShardSourceConfig):
            continue
        try:
            ShardSource(
                src,
                source_index=i,
                geometry=cfg.media_geometry(),
                seq_length=cfg.data.seq_length,
            )
        except Exception as err:
            out.append(f"spec.trainer.data.sources[{i}].url ({src.url}): {describe(err)}")
    if cfg.checkpoint is not None:
        path = cfg.checkpoint.path
        try:
            open_storage(path).list_steps()
        except Exception as err:
            out.append(f"spec.trainer.checkpoint.path ({path}): {describe(err)}")
    return out


def describe(err: BaseException) -> str:
    """``ExceptionType: message``, with what to do when credentials are missing."""
    text = f"{type(err).__name__}: {err}"
    if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        text += f"; {_CREDENTIALS}"
    return text
