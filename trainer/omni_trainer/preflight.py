"""Reachability before the gang trains: every data source opens and the checkpoint storage
answers with this process's credentials, or the problem names the field, the location and the
cause (``omni validate --sources``; ``omni train`` runs it once per pod before the process group
forms, so the cause lands in the pod's termination message and the job's status)."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from omni_trainer.config import TrainerConfig
from omni_trainer.data.config import SyntheticSourceConfig
from omni_trainer.data.sample import media_geometry

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


def check_sources(cfg: TrainerConfig, *, for_export: bool = True) -> SourceCheck:
    """Every data source opened as the trainer opens it (shards listed, indexes read), the
    tokenizer loaded and checked against the model's vocabulary, the checkpoint storage listed,
    and each source's sample lengths surveyed against ``seqLength``. ``for_export``: a
    tokenizer without an encoder's placeholder token is a problem (export and generation need
    it), else a warning (training does not). Problems read
    ``spec.trainer.<field> (<location>): <ExceptionType>: <message>``."""
    from omni_trainer.checkpoint.storage import open_storage
    from omni_trainer.data.loader import build_source
    from omni_trainer.interop.weights_check import check_weights

    out = SourceCheck()
    tokenizer_ok = _check_tokenizer(cfg, out.problems)
    if tokenizer_ok and cfg.tokenizer is not None:  # training runs without; export needs them
        placeholders = _missing_placeholders(cfg)
        (out.problems if for_export else out.warnings).extend(placeholders)
    out.problems += check_weights(cfg.model)
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
                geometry=media_geometry(cfg.model),
                seq_length=cfg.data.seq_length,
                tokenizer=cfg.tokenizer,
                media=cfg.data.media,
            )
        except Exception as err:
            where = getattr(src, "url", None) or src.name
            out.problems.append(f"spec.trainer.data.sources[{i}].url ({where}): {describe(err)}")
            continue
        _survey(built, f"spec.trainer.data.sources[{i}]", cfg.data.seq_length, out)
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


def _missing_placeholders(cfg: TrainerConfig) -> list[str]:
    """Each configured encoder's placeholder (``<image>``, ``<audio>``) must be one token of
    the tokenizer: export writes a LLaVA's tower and projector, and generation marks media, by
    that token (training runs without it, and export would then drop the tower)."""
    from omni_trainer.interop.media_prompt import PLACEHOLDERS
    from omni_trainer.interop.tokenizer import load_checked_tokenizer

    tok = load_checked_tokenizer(cfg)

    if media_geometry(cfg.model).image_wrap is not None:  # Qwen2.5-VL: its own vision tokens
        return []
    out = []
    for modality, _ in cfg.model.encoders.items():
        text = PLACEHOLDERS[modality]
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1 or ids[0] == tok.unk_token_id:
            out.append(
                f"spec.trainer.tokenizer ({cfg.tokenizer}): no {text} token (it encodes to "
                f"{len(ids)} tokens) though model.encoders.{modality} is set: export and "
                f"generation mark {modality} positions with it; add {text} as a special token "
                f"(tokenizer.add_special_tokens({{'additional_special_tokens': ['{text}']}}), "
                "then save_pretrained)"
            )
    return out


def _survey(source: Any, where: str, seq_length: int, out: SourceCheck) -> None:
    """Read up to :data:`SURVEY_SAMPLES` samples as training would: an error when none is
    usable (naming the reasons, one example each), a warning with the share of samples skipped
    as broken (missing, corrupt, placeholder_mismatch...), and one with the share of the
    readable samples longer than ``seqLength`` (media: skipped as too_long; text: split)."""
    from omni_trainer.data.sample import Skipped

    n = source.num_samples or SURVEY_SAMPLES
    picks = sorted({k * n // min(n, SURVEY_SAMPLES) for k in range(min(n, SURVEY_SAMPLES))})
    skipped: Counter[str] = Counter()
    example: dict[str, str] = {}
    split = 0
    with _quiet("omni_trainer.data"):  # the survey's skips are summed up below, not one by one
        for k in picks:
            s = source.get(k)
            if isinstance(s, Skipped):
                skipped[s.reason] += 1
                example.setdefault(s.reason, f"{s.sample_id}: {s.detail}")
            elif s.num_tokens > seq_length:
                split += 1
    name, read = source.name, len(picks)
    too_long = skipped.pop("too_long", 0)
    readable = read - sum(skipped.values())  # what seqLength is measured against
    reasons = "; ".join(
        f"{why} {count} (e.g. {example[why]})" for why, count in skipped.most_common()
    )
    if readable == 0:
        fix = _FIXES.get(skipped.most_common(1)[0][0], "see the reasons")
        out.problems.append(
            f"{where} ({name}): none of the {read} samples read is usable, every one would be "
            f"skipped: {reasons}; {fix}"
        )
        return
    if too_long == readable:
        out.problems.append(
            f"{where} ({name}): all {readable} readable samples are longer than "
            f"data.seqLength ({seq_length}) and would be skipped as too_long; raise seqLength"
        )
        return
    if (read - readable) / read >= WARN_FRACTION:
        out.warnings.append(
            f"{where} ({name}): {read - readable} of {read} samples read "
            f"({(read - readable) / read:.0%}) would be skipped: {reasons}"
        )
    for count, what in ((too_long, "skipped as too_long"), (split, "split into chunks")):
        if count / readable >= WARN_FRACTION:
            out.warnings.append(
                f"{where} ({name}): {count} of {readable} readable samples "
                f"({count / readable:.0%}) are longer than data.seqLength ({seq_length}) and "
                f"are {what}; raise seqLength to keep them whole"
            )


_FIXES = {
    "placeholder_mismatch": "each <image>/<audio>/<video> in the text needs one item of that "
    "kind in the record (image/images, audio/audios, video/videos, or a media content part)",
    "missing": "check the media paths against mediaRoot (default: the annotation file's folder)",
    "corrupt": "the media files do not decode",
    "unsupported_media": "add an encoder for the media (model.encoders) or drop those samples",
    "malformed": "records need conversations or messages with an assistant turn",
    "template": "the tokenizer's chat template cannot be diffed turn by turn",
}
"""What to do when every sample is skipped for the reason."""


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
