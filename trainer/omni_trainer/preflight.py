"""Reachability before the gang trains: every data source opens and the checkpoint storage
answers with this process's credentials, or the problem names the field, the location and the
cause (``omni validate --sources``; ``omni train`` runs it once per pod before the process group
forms, so the cause lands in the pod's termination message and the job's status)."""

from __future__ import annotations

from omni_trainer.config import TrainerConfig
from omni_trainer.data.config import SyntheticSourceConfig

_CREDENTIALS = (
    "S3 credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY from a Secret, AWS_PROFILE, a web identity or instance role) and none "
    "was found"
)


def source_problems(cfg: TrainerConfig) -> list[str]:
    """Every data source that cannot be opened as the trainer opens it (shards listed, indexes
    read, the tokenizer loaded), and a checkpoint storage that cannot be listed, as
    ``spec.trainer.<field> (<location>): <ExceptionType>: <message>``."""
    from omni_trainer.checkpoint.storage import open_storage
    from omni_trainer.data.loader import build_source

    out: list[str] = []
    for i, src in enumerate(cfg.data.sources):
        if isinstance(src, SyntheticSourceConfig):
            continue  # generated: nothing to reach
        try:
            build_source(
                src,
                source_index=i,
                seed=cfg.seed,
                vocab_size=cfg.model.llm.vocab_size,
                geometry=cfg.media_geometry(),
                seq_length=cfg.data.seq_length,
                tokenizer=cfg.tokenizer,
                media=cfg.data.media,
            )
        except Exception as err:
            where = getattr(src, "url", None) or src.name
            out.append(f"spec.trainer.data.sources[{i}].url ({where}): {describe(err)}")
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
