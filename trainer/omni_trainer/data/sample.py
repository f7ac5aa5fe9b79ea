"""One training sample (media before its text), its media as a reference, and the media geometry
the encoders impose."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omni_trainer.data.config import Modality
from omni_trainer.data.media import (
    FixedImageSettings,
    ImageSettings,
    preprocessor_config,
    tower_image_processor,
)

if TYPE_CHECKING:
    from omni_trainer.models.config import ModelConfig

MEDIA_DTYPE = np.dtype(np.float32)
"""What every loaded media array is, whatever its source stores."""


@dataclass(frozen=True)
class MediaRef:
    """A sample's media, not read yet: its key and shape, enough to plan and to load it later.

    Packing, cost models, dataflow planning and reordering work from the shape alone; the
    reorder all-to-all moves this reference (tens of bytes), and only the rank that encodes the
    media loads it, through its own sources (``data.loader.MediaReader``).
    """

    source: int
    """Index of the source in the data config (the same on every rank)."""
    index: int
    """Sample index inside that source."""
    shape: tuple[int, ...]
    """Shape once loaded: image [C,H,W], audio [frames, n_mels], video [T,C,H,W]; float32."""
    item: int = 0
    """Which media item of the sample (conversations may hold several)."""
    frame: int = -1
    """-1: the whole item; k >= 0: the k-th sampled frame of a video item (encoded as an image)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the loaded array."""
        return math.prod(self.shape) * MEDIA_DTYPE.itemsize


@dataclass(frozen=True)
class MediaGeometry:
    """How media maps to LLM positions; the trainer fills it from the encoder configs."""

    patch_size: int = 14
    """Image/video pixels per patch side: one patch = one LLM position."""
    audio_subsampling: int = 4
    """Audio frames per LLM position."""
    n_mels: int = 80
    """Mel bins per audio frame."""
    image_channels: int = 3
    encoders: tuple[str, ...] = ("image", "audio")
    """Modalities the model has an encoder for (media of others cannot be used)."""
    image_extra_tokens: int = 0
    """LLM positions of an image beyond its patches (an imported tower's class token kept: +1,
    its first token dropped: -1, both: 0)."""
    image_processor: FixedImageSettings | None = None
    """An imported tower's processor (CLIP / SigLIP): images are resized and cropped to its
    size instead of the dynamic resolution of ``data.media``."""
    image_settings: ImageSettings | None = None
    """An imported dynamic-resolution tower's processor (Qwen2.5-VL): its pixel bounds, patch
    and merge sizes replace ``data.media``'s (``patch_size`` is then its merged patch)."""
    image_wrap: tuple[int, int] | None = None
    """Token ids the chat renderer writes before and after each image's positions (a whole
    Qwen2.5-VL's ``vision_start_token_id`` and ``vision_end_token_id``)."""
    audio_max_frames: int | None = None
    """Longest clip the audio encoder takes (Whisper's position table); longer clips are cut."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "audio_subsampling", "n_mels", "image_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaGeometry.{name} must be >= 1, got {getattr(self, name)}")

    def media_tokens(self, modality: Modality, media: MediaRef | None) -> int:
        """LLM positions ``media`` takes (its dims must already be multiples of the geometry)."""
        if media is None:
            return 0
        p, extra = self.patch_size, self.image_extra_tokens
        if modality == "image":
            return (media.shape[1] // p) * (media.shape[2] // p) + extra
        if modality == "video":
            return media.shape[0] * ((media.shape[2] // p) * (media.shape[3] // p) + extra)
        if modality == "audio":
            return media.shape[0] // self.audio_subsampling
        raise ValueError(f"modality {modality!r} carries no media")


@dataclass(frozen=True)
class MediaSpan:
    """A media item inside a sample's text (interleaved conversations): ``text`` holds 0 at its
    ``tokens`` positions from ``offset``; the encoder's output replaces them."""

    modality: Modality
    offset: int
    tokens: int
    ref: MediaRef


@dataclass(frozen=True)
class Skipped:
    """What a source returns for a sample it cannot use; the loader counts it by ``reason``
    (``missing``, ``corrupt``, ``too_long``, ...) and draws the next one. Deterministic: the
    same sample is skipped for the same reason after a resume."""

    sample_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True, eq=False)
class Sample:
    """A sample as the packer sees it; ``key`` (+ ``chunk``) is enough to regenerate/re-read it.

    Layout in a sequence: ``media_tokens`` media positions, then ``text``.
    """

    key: tuple[int, int]
    """(source index, sample index) inside the stream."""
    sample_id: str
    """Stable id, e.g. ``openimages/000123`` (``#k`` suffix for chunk k of an over-long text)."""
    modality: Modality
    text: np.ndarray
    """int64 token ids (caption, transcript or document)."""
    media: MediaRef | None = None
    """The media, loaded only by the rank that encodes it."""
    media_tokens: int = 0
    chunk: int = -1
    """-1 for a whole sample, k >= 0 for chunk k of an over-long text sample."""
    spans: tuple[MediaSpan, ...] = ()
    """Media inside ``text`` (conversations), in order; ``media`` is the one before the text."""
    targets: np.ndarray | None = None
    """bool per ``text`` position: the token is a loss target (None: every text token is)."""

    @property
    def num_tokens(self) -> int:
        """LLM positions the sample takes."""
        return self.media_tokens + len(self.text)

    @property
    def state_key(self) -> tuple[int, int, int]:
        """(source, index, chunk): what a loader checkpoint stores for this sample."""
        return (self.key[0], self.key[1], self.chunk)


def split_text(sample: Sample, seq_length: int) -> list[Sample]:
    """Split a text-only sample longer than ``seq_length`` into ``sample_id#k`` chunks (no loss)."""
    if sample.media is not None or sample.modality != "text":
        raise ValueError(f"only text samples are chunked; {sample.sample_id} is {sample.modality}")
    if len(sample.text) <= seq_length:
        return [sample]
    return [chunk_of(sample, k, seq_length) for k in range(-(-len(sample.text) // seq_length))]


def chunk_of(sample: Sample, k: int, seq_length: int) -> Sample:
    """Chunk ``k`` of an over-long text sample (``k = -1``: the sample itself)."""
    if k < 0:
        return sample
    return Sample(
        key=sample.key,
        sample_id=f"{sample.sample_id}#{k}",
        modality=sample.modality,
        text=sample.text[k * seq_length : (k + 1) * seq_length],
        chunk=k,
    )


def media_geometry(model: ModelConfig) -> MediaGeometry:
    """The data pipeline's view of ``model``'s encoders: pixels per patch, frames per token,
    mels."""
    image, audio = model.encoders.image, model.encoders.audio
    imported = image is not None and image.tower is not None
    qwen = image.qwen if imported else None
    processor = settings = None
    if qwen is not None:  # dynamic resolution within the tower processor's pixel bounds
        settings = ImageSettings.from_processor(
            preprocessor_config(image.hf),
            patch_size=image.patch_size,
            merge_size=qwen.merge_size,
            temporal_patch_size=qwen.temporal_patch_size,
        )
    elif imported:  # the tower's own processor sizes the images
        processor = tower_image_processor(
            image.hf, family=image.tower.family, side=image.tower.image_size
        )
    return MediaGeometry(
        patch_size=image.position_side if image else 14,
        audio_subsampling=audio.subsampling if audio else 4,
        n_mels=audio.n_mels if audio else 80,
        encoders=tuple(m for m, _ in model.encoders.items()),
        image_extra_tokens=image.prefix_tokens - image.drop_prefix if imported else 0,
        image_processor=processor,
        image_settings=settings,
        image_wrap=qwen.image_wrap if qwen and model.hf else None,
        audio_max_frames=audio.max_frames if audio else None,
    )
