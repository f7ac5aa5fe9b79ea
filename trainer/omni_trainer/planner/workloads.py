"""The MegaScale-Omni paper's workloads A-D and the sampled packed sequences the planner costs.

A workload is a model, a cluster size, a global batch, a sequence length, its data sources (length
distribution, ``lengthScale``, weight) and the modality token shares. Sequences are drawn the way
the trainer's loader draws them, from lengths alone (no arrays), so a step of thousands of
sequences samples in milliseconds: the trainer's own :class:`~omni_trainer.data.mixture.
DeficitMixer` picks the source, ``data/synthetic.draw_length`` the length, media samples get the
synthetic source's geometry (85% media, images on an (h, w) patch grid, audio one position per
subsampled frame), over-long texts are cut into sequence-long chunks (``data/sample.split_text``)
and a best-fit buffer of ``pack_buffer`` samples packs them like ``data/packing.Packer``.
Image, audio and text are planned; the model has no video encoder, so video is not.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omni_trainer.config import TrainerConfig
from omni_trainer.data.config import PRESETS, LengthDistribution, MixturePoint
from omni_trainer.data.mixture import DeficitMixer, MixtureSchedule
from omni_trainer.data.packing import PackedSequence, Segment
from omni_trainer.data.synthetic import MEDIA_FRACTION, draw_length
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import VisionEncoderConfig

__all__ = [
    "GPT_45B",
    "PLANNED_MODALITIES",
    "RATIOS",
    "SourceShape",
    "Workload",
    "mixture_shares",
    "modality_token_shares",
    "paper_workloads",
    "preset_source",
    "sample_sequences",
    "workload_from_config",
]

RATIOS: tuple[tuple[int, int], ...] = ((1, 9), (3, 7), (5, 5), (7, 3), (9, 1))
"""Image:text token ratios the paper sweeps."""

PLANNED_MODALITIES = ("image", "audio", "text")
"""Modalities the planner samples and costs (one encoder per media modality in the model)."""

GPT_45B = LLMConfig(
    num_layers=56,
    hidden_size=8192,
    num_attention_heads=64,
    num_query_groups=64,
    ffn_hidden_size=32768,
    vocab_size=51200,
    gated_mlp=False,
    normalization="LayerNorm",
)
"""The paper names "GPT-45B" without a shape. Ours: GPT-3 style (GELU MLP of 4h, MHA, GPT-2
vocabulary), width 8192 (as GPT-3's 13B-175B family scales width before depth), 56 layers so
that 12 h^2 L = 45.1B parameters; 64 heads of 128 as in GPT-3."""


@dataclass(frozen=True, kw_only=True)
class SourceShape:
    """One data source as the sampler draws it (a synthetic source's length model)."""

    name: str
    modality: str
    length: LengthDistribution
    scale: float = 1.0
    """``lengthScale`` of the manifest: multiplies every drawn length."""
    weight: float = 1.0
    """Token share inside its modality, relative to its siblings."""


def preset_source(preset: str, *, weight: float = 1.0, scale: float = 1.0) -> SourceShape:
    """A source with one of the paper's length presets (``data/config.PRESETS``)."""
    modality, dist = PRESETS[preset]
    return SourceShape(name=preset, modality=modality, length=dist, scale=scale, weight=weight)


_PAPER_SOURCES = (preset_source("openimages"), preset_source("refcocog"), preset_source("longtext"))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training job to predict: what runs, on how many GPUs, on what data."""

    name: str
    model: ModelConfig
    world_size: int
    global_batch: int
    """Packed sequences per step."""
    seq_length: int
    shares: tuple[tuple[str, float], ...] = (("image", 0.5), ("text", 0.5))
    """Token share per modality (samples of that modality: media + caption)."""
    sources: tuple[SourceShape, ...] = _PAPER_SOURCES
    """The sources drawn from, as in ``examples/vlm-7b.yaml`` by default."""
    pack_buffer: int = 64
    """Samples in the best-fit packing buffer (``data.packBuffer``)."""
    note: str = ""

    def __post_init__(self) -> None:
        for modality, share in self.shares:
            if share < 0:
                raise ValueError(f"share of {modality} must be >= 0, got {share}")
            if modality not in PLANNED_MODALITIES:
                raise ValueError(
                    f"the planner samples {PLANNED_MODALITIES}; {modality!r} has no encoder"
                )
            if share > 0 and not any(s.modality == modality for s in self.sources):
                raise ValueError(f"{modality} has a share of {share} but no source")
            if share > 0 and modality != "text" and getattr(self.model.encoders, modality) is None:
                raise ValueError(
                    f"{modality} has a share of {share} but the model has no encoder for it"
                )
        if not any(share > 0 for _, share in self.shares):
            raise ValueError("at least one modality share must be > 0")

    def with_share(self, image: int, text: int) -> Workload:
        """The same job at another image:text ratio (other modalities dropped)."""
        return _replace(
            self, shares=(("image", image / (image + text)), ("text", text / (image + text)))
        )

    def with_seq_length(self, seq_length: int) -> Workload:
        """The same job at another sequence length (global batch kept in sequences)."""
        return _replace(self, seq_length=seq_length, name=f"{self.name}@{seq_length // 1024}K")


def _replace(w: Workload, **changes: object) -> Workload:
    from dataclasses import replace

    return replace(w, **changes)


def _grid_tokens(budget: int, rng: np.random.Generator) -> int:
    """Patches of a synthetic image with ``budget`` media positions (``SyntheticSource._grid``):
    ``h x w <= budget`` with aspect ratio ``h / w`` drawn log-uniformly in [0.5, 2]."""
    aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    h = min(budget, max(1, round(math.sqrt(budget * aspect))))
    return h * max(1, budget // h)


@dataclass
class _Stream:
    """Samples in the order one loader draws them: the trainer's deficit mixer picks the source."""

    workload: Workload
    rng: np.random.Generator
    counter: int = 0
    sources: list[SourceShape] = field(default_factory=list)
    pending: deque[Segment] = field(default_factory=deque)

    def __post_init__(self) -> None:
        w = self.workload
        live = {m for m, share in w.shares if share > 0}
        self.sources = [s for s in w.sources if s.modality in live]
        point = MixturePoint(at_tokens=0, weights={m: v for m, v in w.shares if v > 0})
        self.mixer = DeficitMixer(
            MixtureSchedule([point]), [(s.modality, s.weight) for s in self.sources]
        )

    def __call__(self) -> Segment:
        if self.pending:
            return self.pending.popleft()
        s_len = self.workload.seq_length
        i = self.mixer.choose()
        src = self.sources[i]
        length = draw_length(src.length, src.scale, self.rng)
        self.counter += 1
        sid = f"{src.name}/{self.counter:07d}"
        if src.modality == "text":
            length = max(2, length)
            self.mixer.record(i, length)
            chunks = [
                Segment(f"{sid}#{k}", "text", 0, min(s_len, length - k * s_len), 0)
                for k in range(-(-length // s_len))
            ]
            self.pending.extend(chunks[1:])
            return chunks[0]
        length = min(max(length, 3), s_len)
        n_text = max(2, length - round(MEDIA_FRACTION * length))
        budget = length - n_text
        media = _grid_tokens(budget, self.rng) if src.modality == "image" else budget
        self.mixer.record(i, media + n_text)
        return Segment(sid, src.modality, 0, media + n_text, media)


_CACHE: dict[tuple, list[PackedSequence]] = {}
_CACHE_SIZE = 16


def sample_sequences(workload: Workload, count: int, *, seed: int = 0) -> list[PackedSequence]:
    """``count`` packed sequences of the workload (best fit over ``workload.pack_buffer``).

    Returns real :class:`~omni_trainer.data.packing.PackedSequence` objects (without sample
    arrays), so the trainer's own helpers (``multiplex/workload.encoder_micro_batches``,
    ``costs/model_flops``) read them. The stream is a pure function of the data fields and
    the seed, and a longer draw starts with a shorter one, so draws are cached by those (the tuner
    samples the same data for every configuration).
    """
    key = (workload.shares, workload.sources, workload.seq_length, workload.pack_buffer, seed)
    have = _CACHE.get(key, [])
    if len(have) < count:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        have = _CACHE[key] = _sample(workload, max(count, 2 * len(have)), seed=seed)
    return have[:count]


def _sample(workload: Workload, count: int, *, seed: int) -> list[PackedSequence]:
    draw = _Stream(workload, np.random.default_rng(seed))
    pending: list[Segment] = []
    out: list[PackedSequence] = []
    for _ in range(count):
        segments: list[Segment] = []
        offset = 0
        while True:
            while len(pending) < workload.pack_buffer:
                pending.append(draw())
            room = workload.seq_length - offset
            best = -1
            for i, s in enumerate(pending):
                if s.length <= room and (best < 0 or s.length > pending[best].length):
                    best = i
            if best < 0:
                break
            s = pending.pop(best)
            segments.append(Segment(s.sample_id, s.modality, offset, s.length, s.media_tokens))
            offset += s.length
            if offset == workload.seq_length:
                break
        out.append(PackedSequence(workload.seq_length, segments, []))
    return out


def modality_token_shares(sequences: Sequence[PackedSequence]) -> dict[str, float]:
    """Measured share of used positions per modality (to check the sampler hits the mix)."""
    used = sum(s.used for s in sequences)
    out: dict[str, float] = {}
    for s in sequences:
        for g in s.segments:
            out[g.modality] = out.get(g.modality, 0.0) + g.length / used
    return out


def paper_workloads() -> dict[str, Workload]:
    """Workloads A-D as the paper lists them (16K for A/B, 8K for C/D), image:text 5:5."""

    def vit(preset: str) -> EncodersConfig:
        return EncodersConfig(image=VisionEncoderConfig(preset=preset))

    return {
        "A": Workload(
            name="A",
            model=ModelConfig(llm=LLMConfig(preset="llama-7b"), encoders=vit("vit-l-14")),
            world_size=64,
            global_batch=256,
            seq_length=16384,
            note="LLaMA-7B + ViT-L/14",
        ),
        "B": Workload(
            name="B",
            model=ModelConfig(llm=LLMConfig(preset="llama-13b"), encoders=vit("vit-g-14")),
            world_size=128,
            global_batch=512,
            seq_length=16384,
            note="LLaMA-13B + ViT-g/14",
        ),
        "C": Workload(
            name="C",
            model=ModelConfig(llm=GPT_45B, encoders=vit("vit-G-14")),
            world_size=256,
            global_batch=1024,
            seq_length=8192,
            note="GPT-45B (h8192 L56, our shape) + ViT-G/14",
        ),
        "D": Workload(
            name="D",
            model=ModelConfig(llm=LLMConfig(preset="gpt-175b"), encoders=vit("vit-h-14")),
            world_size=512,
            global_batch=2048,
            seq_length=8192,
            note="GPT-175B + ViT-H/14",
        ),
    }


def mixture_shares(
    points: Sequence[MixturePoint], *, start: float, end: float, samples: int = 64
) -> dict[str, float]:
    """Token shares per modality averaged over the tokens ``[start, end)`` of a training run.

    The trainer's :class:`~omni_trainer.data.mixture.MixtureSchedule` gives the shares at each
    token count; the average over the window is what a run of those tokens draws.
    """
    schedule = MixtureSchedule(points)
    if end <= start:
        return dict(schedule.weights(int(start)))
    acc: dict[str, float] = {}
    for k in range(samples):
        at = start + (k + 0.5) * (end - start) / samples
        for m, v in schedule.weights(int(at)).items():
            acc[m] = acc.get(m, 0.0) + v / samples
    return acc


def workload_from_config(
    cfg: TrainerConfig,
    *,
    world_size: int,
    name: str = "job",
    tokens: tuple[float, float] | None = None,
) -> Workload:
    """A job manifest's trainer section as a planner workload (``omni plan``, calibration).

    Synthetic sources keep their length shape, ``lengthScale`` and weight; a modality with only
    shard sources (lengths unknown until read) uses the paper's preset of that modality. The
    modality shares are the mixture averaged over ``tokens = (start, end)``, by default the whole
    run (``train.steps`` x global batch x sequence length tokens).

    Raises:
        ValueError: the mixture gives a share to video (the model has no video encoder).
    """
    data = cfg.data
    if tokens is None:
        tokens = (0.0, float(cfg.train.steps * data.global_batch_size * data.seq_length))
    shares = mixture_shares(data.mixture, start=tokens[0], end=tokens[1])
    if shares.get("video", 0.0) > 0:
        raise ValueError("the planner cannot cost video: the model has no video encoder")
    sources: list[SourceShape] = []
    notes: list[str] = []
    for s in data.sources:
        if s.kind == "synthetic" and s.modality in PLANNED_MODALITIES:
            sources.append(
                SourceShape(
                    name=s.name, modality=s.modality, length=s.length_distribution(),
                    scale=s.length_scale, weight=s.weight,
                )
            )  # fmt: skip
    for m, share in shares.items():
        if share > 0 and not any(s.modality == m for s in sources):
            preset = next(k for k, (pm, _) in PRESETS.items() if pm == m)
            sources.append(preset_source(preset))
            notes.append(f"{m}: lengths of the {preset} preset (shard sources)")
    return Workload(
        name=name,
        model=cfg.model,
        world_size=world_size,
        global_batch=data.global_batch_size,
        seq_length=data.seq_length,
        shares=tuple((m, v) for m, v in shares.items() if m in PLANNED_MODALITIES),
        sources=tuple(sources),
        pack_buffer=data.pack_buffer,
        note="; ".join(notes),
    )
