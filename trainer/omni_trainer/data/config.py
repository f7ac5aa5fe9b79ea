"""The ``data`` section of the job manifest: sources, sample-length shapes, the modality mixture.

Every check names the manifest field it concerns, so a user can fix a job without reading code.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from omni_trainer.config_base import Spec

Modality = Literal["image", "audio", "video", "text"]
MODALITIES: tuple[Modality, ...] = ("image", "audio", "video", "text")

Preset = Literal["openimages", "refcocog", "librispeech", "longtext"]


def not_below(value: int, low: int | None, *, names: tuple[str, str]) -> int:
    """``value`` unless a set lower bound exceeds it (a field validator's upper-bound check)."""
    if low is not None and value < low:
        raise ValueError(f"{names[0]} ({value}) must be >= {names[1]} ({low})")
    return value


class LengthDistribution(Spec):
    """Sample length in LLM tokens (media + text): a clipped lognormal, skewed like real corpora."""

    mean: float = Field(gt=0)
    """Mean of the (unclipped) lognormal, in tokens."""
    sigma: float = Field(default=0.5, ge=0)
    """Shape of the lognormal (std of log-length); 0 makes every sample ``mean`` tokens long."""
    min: int = Field(default=1, ge=1)
    """Shortest sample, in tokens (before ``lengthScale``)."""
    max: int = Field(default=1 << 20, ge=1)
    """Longest sample, in tokens (before ``lengthScale``)."""

    @field_validator("max")
    @classmethod
    def _max_at_least_min(cls, v: int, info: ValidationInfo) -> int:
        return not_below(v, info.data.get("min"), names=("max", "min"))


# The paper's figures: OpenImages mean 3.8K tokens (skewed), RefCOCOg 1.4K, LibriSpeech 0.34K,
# long text 6K with documents up to 512K. The sigmas are our choice: 0.6 gives OpenImages a long
# right tail (p99 ~ 3.4x mean); RefCOCOg crops are more uniform (0.4); LibriSpeech utterances are
# bounded (0.35, max 2K); long text gets the heavy tail (1.0, p99 ~ 6x mean, up to 512K).
PRESETS: dict[str, tuple[Modality, LengthDistribution]] = {
    "openimages": ("image", LengthDistribution(mean=3800, sigma=0.6, min=256, max=16384)),
    "refcocog": ("image", LengthDistribution(mean=1400, sigma=0.4, min=256, max=8192)),
    "librispeech": ("audio", LengthDistribution(mean=340, sigma=0.35, min=32, max=2048)),
    "longtext": ("text", LengthDistribution(mean=6000, sigma=1.0, min=512, max=524288)),
}


class SyntheticSourceConfig(Spec):
    """A generated, learnable source: lengths follow a preset or an explicit distribution."""

    kind: Literal["synthetic"]
    name: str = Field(min_length=1)
    """Unique source name; prefixes every sample id."""
    modality: Modality
    preset: Preset | None = None
    """Length shape from the paper; its modality must match ``modality``."""
    length: LengthDistribution | None = None
    """Explicit length shape; overrides ``preset``."""
    length_scale: float = Field(default=1.0, gt=0)
    """Multiplies lengths (the tiny CPU example uses ~0.02 of the paper's sizes)."""
    weight: float = Field(default=1.0, gt=0)
    """Token share of this source inside its modality, relative to its siblings."""
    num_classes: int = Field(default=8, ge=1, le=64)
    """Classes carried by media samples (each has its own pattern and class token)."""

    @field_validator("preset")
    @classmethod
    def _preset_matches_modality(cls, v: str | None, info: ValidationInfo) -> str | None:
        modality = info.data.get("modality")
        if v is not None and modality is not None and PRESETS[v][0] != modality:
            allowed = sorted(k for k, (m, _) in PRESETS.items() if m == modality)
            raise ValueError(
                f"preset {v!r} is for modality {PRESETS[v][0]!r}, not {modality!r}; "
                f"presets for {modality!r}: {allowed or 'none (set length instead)'}"
            )
        return v

    @field_validator("length")
    @classmethod
    def _preset_or_length(
        cls, v: LengthDistribution | None, info: ValidationInfo
    ) -> LengthDistribution | None:
        if v is None and info.data.get("preset") is None and "preset" in info.data:
            raise ValueError(
                "one of preset or length is required: preset in "
                f"{sorted(PRESETS)} or length {{mean, sigma, min, max}}"
            )
        return v

    def length_distribution(self) -> LengthDistribution:
        """The effective length shape (``length`` wins over ``preset``), before scaling."""
        if self.length is not None:
            return self.length
        assert self.preset is not None  # guaranteed by validation
        return PRESETS[self.preset][1]


class ShardSourceConfig(Spec):
    """WebDataset-style ``.tar`` shards in a local directory/glob or under ``s3://bucket/prefix``."""

    kind: Literal["shards"]
    name: str = Field(min_length=1)
    modality: Modality
    url: str = Field(min_length=1)
    """Local directory, glob of ``.tar`` files, or ``s3://bucket/prefix``."""
    weight: float = Field(default=1.0, gt=0)
    """Token share of this source inside its modality, relative to its siblings."""


class ConversationSourceConfig(Spec):
    """LLaVA-style JSON / JSONL (``id``, ``image`` (one or a list), ``audio``, ``video``,
    ``conversations: [{from, value}]``), ms-swift / LLaMA-Factory records (``images``,
    ``audios``, ``videos`` lists) or OpenAI-style ``messages`` (content parts may carry the
    media: ``image_url``, ``input_audio``), with media files beside it. Rendered through
    ``spec.trainer.tokenizer``'s chat template; loss on assistant turns only."""

    kind: Literal["conversations"]
    name: str = Field(min_length=1)
    url: str = Field(min_length=1)
    """The annotation file (.json array or .jsonl), local or ``s3://bucket/key``."""
    media_root: str | None = None
    """Directory or ``s3://`` prefix media paths are relative to; default: the file's folder."""
    modality: Modality
    """The mixture share this source's tokens count toward."""
    weight: float = Field(default=1.0, gt=0)
    """Token share of this source inside its modality, relative to its siblings."""
    system_prompt: str | None = None
    """A system message put first in conversations that have none."""


class WebDatasetSourceConfig(Spec):
    """Standard WebDataset tars: ``key.jpg|jpeg|png|webp``, ``key.wav|flac|mp3``, ``key.mp4``
    with ``key.txt`` (a caption) or ``key.json`` (``caption``/``text``, or ``conversations``/
    ``messages``). A caption becomes a conversation: ``prompt`` as the user turn, the caption as
    the assistant's reply (the loss)."""

    kind: Literal["webdataset"]
    name: str = Field(min_length=1)
    url: str = Field(min_length=1)
    """A directory or glob of ``.tar`` files, or an ``s3://bucket/prefix``."""
    modality: Modality
    """The mixture share this source's tokens count toward."""
    weight: float = Field(default=1.0, gt=0)
    """Token share of this source inside its modality, relative to its siblings."""
    prompt: str = "Describe this."
    """User turn of captioned samples (media placeholders are added in front if missing)."""
    system_prompt: str | None = None
    """A system message put first in conversations that have none."""


class ParquetSourceConfig(WebDatasetSourceConfig):
    """Hugging Face datasets' parquet exports: ``image``/``images`` and ``audio`` columns of
    ``{bytes, path}`` (or raw bytes), and ``conversations``/``messages`` or ``caption``/``text``
    columns; captions become conversations through ``prompt`` as for WebDataset."""

    kind: Literal["parquet"]  # type: ignore[assignment]
    url: str = Field(min_length=1)
    """A directory or glob of ``.parquet`` files, or an ``s3://bucket/prefix``."""


class MediaConfig(Spec):
    """How media files become encoder inputs (HF processor semantics, see ``data/media.py``).
    Fields left out take the model's ``preprocessor_config.json`` values when one sits beside
    ``spec.trainer.tokenizer`` (a Hugging Face model directory), else these defaults."""

    min_pixels: int = Field(default=56 * 56, ge=1)
    """Images are resized (aspect kept, sides multiples of the patch) to at least this area."""
    max_pixels: int = Field(default=14 * 14 * 1024, ge=1)
    """... and at most this area (pixels per image; it bounds the image's LLM positions)."""
    fps: float = Field(default=2.0, gt=0)
    """Video frames sampled per second."""
    max_frames: int = Field(default=64, ge=2)
    """Most frames sampled from one video."""
    video_total_pixels: int | None = Field(default=None, ge=1)
    """Pixel budget over all frames of a video; frames shrink to fit it."""
    sample_rate: int = Field(default=16000, ge=1000)
    """Audio is resampled to this rate before the log-mel features."""

    @field_validator("max_pixels")
    @classmethod
    def _max_above_min(cls, v: int, info: ValidationInfo) -> int:
        return not_below(v, info.data.get("min_pixels"), names=("maxPixels", "minPixels"))


class PrefetchConfig(Spec):
    """Media reading and decoding off the training thread."""

    workers: int = Field(default=2, ge=0)
    """Decoding threads per rank; 0 decodes on the training thread."""
    depth: dict[Modality, Annotated[int, Field(ge=0, le=8)]] = Field(
        default_factory=lambda: {"image": 1, "audio": 1, "video": 1}
    )
    """Steps read ahead per modality (0: decode that modality only in its own step). Read-ahead
    needs the next steps' media to be predictable on this rank: pipeline parallelism 1 and no
    reordering between ranks; otherwise each step's media are decoded in parallel when the step
    starts."""


SourceConfig = Annotated[
    SyntheticSourceConfig
    | ShardSourceConfig
    | ConversationSourceConfig
    | WebDatasetSourceConfig
    | ParquetSourceConfig,
    Field(discriminator="kind"),
]


class MixturePoint(Spec):
    """Modality token shares from ``atTokens`` on (linearly interpolated to the next point)."""

    at_tokens: int = Field(ge=0)
    weights: dict[Modality, Annotated[float, Field(ge=0)]]
    """Relative token share per modality; at least one must be > 0."""

    @field_validator("weights")
    @classmethod
    def _some_positive(cls, v: dict[str, float]) -> dict[str, float]:
        if not any(w > 0 for w in v.values()):
            raise ValueError(f"at least one weight must be > 0 (got {v}); modalities: {MODALITIES}")
        return v


class ReorderConfig(Spec):
    """Balance encoder and LLM work across data-parallel ranks inside network-local groups."""

    group_size: int = Field(default=1, ge=1)
    """Data-parallel ranks per reorder group (1: no reordering). Groups are consecutive ranks;
    the operator places each group inside one network domain."""
    method: Literal["kk", "lpt", "none"] = "kk"
    """Karmarkar-Karp (balanced, with swap refinement), greedy LPT, or keep data in place."""


class DataConfig(Spec):
    """Where samples come from, how they are mixed and how they are packed into sequences."""

    seq_length: int = Field(ge=8)
    """LLM positions per packed sequence."""
    global_batch_size: int = Field(ge=1)
    """Packed sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = Field(ge=1)
    """Packed sequences per forward/backward pass on one rank."""
    sources: list[SourceConfig] = Field(min_length=1)
    mixture: list[MixturePoint] = Field(default_factory=list)
    """Schedule of modality shares by tokens seen; default: equal shares over the sources."""
    pack_buffer: int = Field(default=64, ge=1)
    """Samples kept in the best-fit packing buffer."""
    loader_shards: int | None = Field(default=None, ge=1)
    """Decentralized loaders: each reads every ``loaderShards``-th sample of every source and
    packs its own ``globalBatchSize / loaderShards`` sequences per step; a data-parallel rank
    hosts ``loaderShards / dp`` of them. Default: one per data-parallel rank. Set it to keep the
    global batch identical across data-parallel sizes that divide it (e.g. to compare layouts)."""
    reorder: ReorderConfig = Field(default_factory=lambda: ReorderConfig())
    """Grouped reordering of sequences between data-parallel ranks (the paper's technique 7)."""
    media: MediaConfig = Field(default_factory=lambda: MediaConfig())
    """Image, audio and video preprocessing of file-based sources."""
    prefetch: PrefetchConfig = Field(default_factory=lambda: PrefetchConfig())
    """Worker threads and read-ahead depths for media decoding."""

    def shards_for(self, dp_size: int) -> int:
        """Loader shards of a run with ``dp_size`` data-parallel ranks."""
        return self.loader_shards or dp_size

    @field_validator("loader_shards")
    @classmethod
    def _shards_divide_batch(cls, v: int | None, info: ValidationInfo) -> int | None:
        gbs = info.data.get("global_batch_size")
        if v is not None and gbs is not None and gbs % v:
            raise ValueError(
                f"loaderShards ({v}) must divide globalBatchSize ({gbs}): every loader packs "
                "the same number of sequences"
            )
        return v

    @field_validator("micro_batch_size")
    @classmethod
    def _divides_global(cls, v: int, info: ValidationInfo) -> int:
        gbs = info.data.get("global_batch_size")
        if gbs is not None and gbs % v != 0:
            raise ValueError(
                f"microBatchSize ({v}) must divide globalBatchSize ({gbs}); "
                f"allowed: a divisor of {gbs}"
            )
        return v

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, v: list) -> list:
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names must be unique; duplicated: {dup}")
        return v

    @field_validator("mixture")
    @classmethod
    def _check_mixture(cls, v: list[MixturePoint], info: ValidationInfo) -> list[MixturePoint]:
        sources = info.data.get("sources")
        if sources is None:  # sources already failed; their error is reported
            return v
        have = [m for m in MODALITIES if any(s.modality == m for s in sources)]
        if not v:
            return [MixturePoint(at_tokens=0, weights=dict.fromkeys(have, 1.0))]
        if v[0].at_tokens != 0:
            raise ValueError(f"mixture[0].atTokens must be 0 (got {v[0].at_tokens})")
        for i in range(1, len(v)):
            if v[i].at_tokens <= v[i - 1].at_tokens:
                raise ValueError(
                    f"mixture[{i}].atTokens ({v[i].at_tokens}) must be > "
                    f"mixture[{i - 1}].atTokens ({v[i - 1].at_tokens}): strictly increasing"
                )
        for i, point in enumerate(v):
            for m, w in point.weights.items():
                if w > 0 and m not in have:
                    raise ValueError(
                        f"mixture[{i}].weights.{m} is {w} but no source has modality {m!r}; "
                        f"sources cover {have}"
                    )
        return v
