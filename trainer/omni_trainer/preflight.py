"""Reachability before the gang trains: every data source opens and the checkpoint storage
answers with this process's credentials, or the problem names the field, the location and the
cause (``omni validate --sources``; ``omni train`` runs it once per pod before the process group
forms, so the cause lands in the pod's termination message and the job's status)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from omni_trainer.config import TrainerConfig
from omni_trainer.data.config import SyntheticSourceConfig

_CREDENTIALS = (
    "S3 credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY from a Secret, AWS_PROFILE, a web identity or instance role) and none "
    "was found"
)


SURVEY_SAMPLES = 256
"""Samples read per source (evenly spread) to measure lengths against ``seqLength``."""
WARN_FRACTION = 0.01  # below this share of too-long samples, say nothing
_NEEDS_TOKENIZER = ("conversations", "webdataset", "parquet")


@dataclass
class SourceCheck:
    """What opening the job's storage found: ``problems`` stop the job before it starts;
    ``warnings`` are said once (lengths the job lets through but that change the data)."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_sources(cfg: TrainerConfig) -> SourceCheck:
    """Every data source opened as the trainer opens it (shards listed, indexes read), the
    tokenizer loaded and checked against the model's vocabulary, the checkpoint storage listed,
    and each source's sample lengths surveyed against ``seqLength``. Problems read
    ``spec.trainer.<field> (<location>): <ExceptionType>: <message>``."""
    from omni_trainer.checkpoint.storage import open_storage
    from omni_trainer.data.loader import build_source

    out = SourceCheck()
    tokenizer_ok = _check_tokenizer(cfg, out.problems)
    for i, src in enumerate(cfg.data.sources):
        if isinstance(src, SyntheticSourceConfig):
            continue  # generated: nothing to reach (lengths are checked from the manifest)
        if src.kind in _NEEDS_TOKENIZER and not tokenizer_ok:
            continue  # its one problem is the tokenizer's, said above
        try:
            built = build_source(
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
            out.problems.append(f"spec.trainer.data.sources[{i}].url ({where}): {describe(err)}")
            continue
        _survey_lengths(built, f"spec.trainer.data.sources[{i}]", cfg.data.seq_length, out)
    if cfg.checkpoint is not None:
        path = cfg.checkpoint.path
        try:
            open_storage(path).list_steps()
        except Exception as err:
            out.problems.append(f"spec.trainer.checkpoint.path ({path}): {describe(err)}")
    return out


def _check_tokenizer(cfg: TrainerConfig, problems: list[str]) -> bool:
    """The tokenizer loads and every id it makes fits the model's vocabulary (appends the
    problem otherwise); True when there is none to check."""
    if cfg.tokenizer is None:
        return True
    from omni_trainer.interop.source import HFModelError
    from omni_trainer.interop.tokenizer import load_checked_tokenizer

    try:
        load_checked_tokenizer(cfg)
    except HFModelError as err:  # names the field, both sizes and the fix
        problems.append(str(err))
        return False
    except Exception as err:
        problems.append(f"spec.trainer.tokenizer ({cfg.tokenizer}): {describe(err)}")
        return False
    return True


def _survey_lengths(source: Any, where: str, seq_length: int, out: SourceCheck) -> None:
    """Samples longer than ``seqLength`` are skipped (media) or split into chunks (text): an
    error when every surveyed sample would be skipped, a warning with the share otherwise."""
    from omni_trainer.data.sample import Skipped

    n = source.num_samples or SURVEY_SAMPLES
    picks = sorted({k * n // min(n, SURVEY_SAMPLES) for k in range(min(n, SURVEY_SAMPLES))})
    too_long = split = 0
    with _quiet("omni_trainer.data"):  # the survey's skips are summed up below, not one by one
        for k in picks:
            s = source.get(k)
            if isinstance(s, Skipped):
                too_long += s.reason == "too_long"
            elif s.num_tokens > seq_length:
                split += 1
    name, read = source.name, len(picks)
    if too_long == read:
        out.problems.append(
            f"{where} ({name}): all {read} samples read are longer than data.seqLength "
            f"({seq_length}) and would be skipped as too_long; raise seqLength"
        )
        return
    for count, what in ((too_long, "skipped as too_long"), (split, "split into chunks")):
        if count / read >= WARN_FRACTION:
            out.warnings.append(
                f"{where} ({name}): {count} of {read} samples read ({count / read:.0%}) are "
                f"longer than data.seqLength ({seq_length}) and are {what}; raise seqLength "
                "to keep them whole"
            )


@contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(before)


def describe(err: BaseException) -> str:
    """``ExceptionType: message``, with what to do when credentials are missing."""
    text = f"{type(err).__name__}: {err}"
    if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        text += f"; {_CREDENTIALS}"
    return text
