"""A generated source that a tiny model can learn from, with deterministic random access.

Token ids (inside ``vocab_size``):
    0                         pad (never a label)
    1 .. MAX_CLASSES          class tokens: class c is ``CLASS_TOKEN_BASE + c``; the first text
                              token after a media sample, predictable only from the media
    FIRST_TEXT_ID .. vocab-1  ordinary text, drawn from a sparse random bigram table (4 successors
                              per token, probabilities 0.5/0.25/0.15/0.1), fixed by the seed and
                              shared by every source
Media carries its class: images/video are a class colour + class sinusoid + noise, audio a class
mel profile + temporal modulation + noise. Loss therefore falls on both the bigram text and the
class token, the latter only if the encoder output reaches the LLM.
"""

from __future__ import annotations

import math

import numpy as np

from omni_trainer.data.config import LengthDistribution, Modality, SyntheticSourceConfig
from omni_trainer.data.sample import MediaGeometry, MediaRef, Sample

PAD_ID = 0
CLASS_TOKEN_BASE = 1
MAX_CLASSES = 64
FIRST_TEXT_ID = CLASS_TOKEN_BASE + MAX_CLASSES
MIN_VOCAB_SIZE = FIRST_TEXT_ID + 16
SUCCESSOR_PROBS = np.array([0.5, 0.25, 0.15, 0.1])
MEDIA_FRACTION = 0.85
NOISE_STD = 0.3
_MODALITY_TAG = {"image": 1, "audio": 2, "video": 3, "text": 4}
_NOISE_STREAM = 0x9015E


def class_token(c: int) -> int:
    """Token id announcing class ``c`` after a media sample."""
    return CLASS_TOKEN_BASE + c


def bigram_table(seed: int, vocab_size: int) -> np.ndarray:
    """Successors [vocab_size, 4] of every id (all in the text range); fixed by the seed."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (ids 0..{FIRST_TEXT_ID - 1} "
            f"are pad and class tokens), got {vocab_size}"
        )
    rng = np.random.default_rng([seed, 0xB16])
    return rng.integers(FIRST_TEXT_ID, vocab_size, size=(vocab_size, len(SUCCESSOR_PROBS)))


def draw_length(dist: LengthDistribution, scale: float, rng: np.random.Generator) -> int:
    """A lognormal length with mean ``dist.mean``, clipped to [min, max], then scaled."""
    if dist.sigma > 0:
        mu = math.log(dist.mean) - dist.sigma**2 / 2
        raw = rng.lognormal(mu, dist.sigma)
    else:
        raw = dist.mean
    raw = min(max(raw, dist.min), dist.max)
    return max(1, round(raw * scale))


class SyntheticSource:
    """Random access: ``get(index)`` and ``load_media`` are pure functions of (seed, source
    index, index)."""

    num_samples: int | None = None  # infinite

    def __init__(
        self,
        config: SyntheticSourceConfig,
        *,
        source_index: int,
        seed: int,
        vocab_size: int,
        geometry: MediaGeometry,
        seq_length: int,
    ) -> None:
        self.config = config
        self.name = config.name
        self.modality: Modality = config.modality
        self.source_index = source_index
        self.seed = seed
        self.vocab_size = vocab_size
        self.geometry = geometry
        self.seq_length = seq_length
        self._dist = config.length_distribution()
        self._succ = bigram_table(seed, vocab_size)
        self._cum = np.cumsum(SUCCESSOR_PROBS)
        # Class patterns depend on (seed, modality, class) only, so sibling sources agree.
        prng = np.random.default_rng([seed, 0xC1A55, _MODALITY_TAG[config.modality]])
        k, ch = config.num_classes, geometry.image_channels
        self._color = prng.uniform(-1, 1, size=(k, ch)).astype(np.float32)
        self._freq = prng.uniform(0.5, 3.0, size=(k, ch, 2)).astype(np.float32)
        self._phase = prng.uniform(0, 2 * np.pi, size=(k, ch)).astype(np.float32)
        self._profile = prng.uniform(-1, 1, size=(k, geometry.n_mels)).astype(np.float32)

    def get(self, index: int) -> Sample:
        """Sample ``index`` of this source (regenerated identically on every call); its media is
        a reference whose shape is drawn here and whose pixels :meth:`load_media` generates."""
        rng, length = self._start(index)
        sid = f"{self.name}/{index:06d}"
        if self.modality == "text":
            first = int(rng.integers(FIRST_TEXT_ID, self.vocab_size))
            text = self._walk(first, max(2, length), rng)
            return Sample(key=(self.source_index, index), sample_id=sid, modality="text", text=text)
        length = min(max(length, 3), self.seq_length)
        n_text = max(2, length - round(MEDIA_FRACTION * length))
        budget = length - n_text  # >= 1 media position
        c = int(rng.integers(0, self.config.num_classes))
        media = MediaRef(self.source_index, index, self._shape(budget, rng))
        text = self._walk(class_token(c), n_text, rng)
        return Sample(
            key=(self.source_index, index),
            sample_id=sid,
            modality=self.modality,
            text=text,
            media=media,
            media_tokens=self.geometry.media_tokens(self.modality, media),
        )

    def load_media(self, ref: MediaRef) -> np.ndarray:
        """The media ``get(ref.index)`` refers to: its class pattern plus noise from a random
        stream of its own, so the text and shape never depend on the pixels."""
        rng, _ = self._start(ref.index)
        c = int(rng.integers(0, self.config.num_classes))
        noise = np.random.default_rng([self.seed, self.source_index, ref.index, _NOISE_STREAM])
        if self.modality == "image":
            return self._image(c, ref.shape[1:], 0.0, noise)
        if self.modality == "video":
            return np.stack(
                [self._image(c, ref.shape[2:], 0.4 * t, noise) for t in range(ref.shape[0])]
            )
        # audio: a class mel profile, modulated over time
        n = ref.shape[0]
        t = np.arange(n, dtype=np.float32)[:, None] / n
        spec = self._profile[c][None, :] + 0.3 * np.sin(2 * np.pi * (1 + c % 4) * t)
        spec = spec + noise.normal(0, NOISE_STD, size=spec.shape)
        return spec.astype(np.float32)

    def _start(self, index: int) -> tuple[np.random.Generator, int]:
        """The sample's random stream and its first draw, the length."""
        rng = np.random.default_rng([self.seed, self.source_index, index])
        return rng, draw_length(self._dist, self.config.length_scale, rng)

    def _walk(self, first: int, n: int, rng: np.random.Generator) -> np.ndarray:
        slots = np.searchsorted(self._cum, rng.random(n), side="right").clip(max=len(self._cum) - 1)
        out = np.empty(n, dtype=np.int64)
        out[0] = tok = first
        succ = self._succ
        for i in range(1, n):
            tok = succ[tok, slots[i]]
            out[i] = tok
        return out

    def _grid(self, budget: int, rng: np.random.Generator) -> tuple[int, int]:
        """(h, w) patches with h*w <= budget, close to it, aspect ratio h/w in ~[0.5, 2]."""
        aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
        h = min(budget, max(1, round(math.sqrt(budget * aspect))))
        return h, max(1, budget // h)

    def _shape(self, budget: int, rng: np.random.Generator) -> tuple[int, ...]:
        """Media shape taking at most ``budget`` LLM positions."""
        g = self.geometry
        p, ch, extra = g.patch_size, g.image_channels, g.image_extra_tokens
        if self.modality == "image":
            h, w = self._grid(max(1, budget - extra), rng)
            return (ch, h * p, w * p)
        if self.modality == "video":
            frames = max(1, min(8, budget // 16))
            h, w = self._grid(max(1, budget // frames - extra), rng)
            return (frames, ch, h * p, w * p)
        # audio: budget positions x subsampling frames of n_mels, within the encoder's limit
        frames = budget * g.audio_subsampling
        if g.audio_max_frames is not None:
            frames = min(frames, g.audio_max_frames // g.audio_subsampling * g.audio_subsampling)
        return (frames, g.n_mels)

    def _image(
        self, c: int, hw: tuple[int, ...], shift: float, rng: np.random.Generator
    ) -> np.ndarray:
        height, width = hw
        y = (np.arange(height, dtype=np.float32) / height)[None, :, None]
        x = (np.arange(width, dtype=np.float32) / width)[None, None, :]
        fy = self._freq[c, :, 0][:, None, None]
        fx = self._freq[c, :, 1][:, None, None]
        phase = (self._phase[c] + shift)[:, None, None]
        img = self._color[c][:, None, None] + 0.5 * np.sin(2 * np.pi * (fy * y + fx * x) + phase)
        img = img + rng.normal(0, NOISE_STD, size=img.shape)
        return img.astype(np.float32)
