"""The paper's workloads A-D (PAPER.md) and the sampled packed sequences the planner costs.

A workload is a model, a cluster size, a global batch, a sequence length and an image:text token
mix. Sequences are drawn with the data presets' length distributions (``data/config.PRESETS``,
``data/synthetic.draw_length``, 85% of an image sample's positions are media as in the synthetic
source) and packed best-fit like ``data/packing.Packer``, but from lengths alone (no arrays), so a
step of thousands of sequences samples in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omni_trainer.config import TrainerConfig
from omni_trainer.data.config import PRESETS
from omni_trainer.data.packing import PackedSequence, Segment
from omni_trainer.data.synthetic import MEDIA_FRACTION, draw_length
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import VisionEncoderConfig

__all__ = [
    "GPT_45B",
    "RATIOS",
    "Workload",
    "paper_workloads",
    "sample_sequences",
    "workload_from_config",
]

RATIOS: tuple[tuple[int, int], ...] = ((1, 9), (3, 7), (5, 5), (7, 3), (9, 1))
"""Image:text token ratios the paper sweeps."""

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
class Workload:
    """One training job to predict: what runs, on how many GPUs, on what data."""

    name: str
    model: ModelConfig
    world_size: int
    global_batch: int
    """Packed sequences per step."""
    seq_length: int
    image_share: float = 0.5
    """Token share of image samples (media + caption); the rest is text."""
    image_sources: tuple[tuple[str, float], ...] = (("openimages", 1.0), ("refcocog", 1.0))
    """(data preset, weight) of the image sources, as in ``examples/vlm-7b.yaml``."""
    text_source: str = "longtext"
    note: str = ""

    def with_share(self, image: int, text: int) -> Workload:
        """The same job at another image:text ratio."""
        return _replace(self, image_share=image / (image + text))

    def with_seq_length(self, seq_length: int) -> Workload:
        """The same job at another sequence length (global batch kept in sequences)."""
        return _replace(self, seq_length=seq_length, name=f"{self.name}@{seq_length // 1024}K")


def _replace(w: Workload, **changes: object) -> Workload:
    from dataclasses import replace

    return replace(w, **changes)


def _clipped_mean(preset: str, seq_length: int, rng: np.random.Generator) -> float:
    """Mean LLM positions of a preset's samples after clipping to the sequence (Monte Carlo)."""
    dist = PRESETS[preset][1]
    return float(np.mean([min(draw_length(dist, 1.0, rng), seq_length) for _ in range(2000)]))


@dataclass
class _Draw:
    """Draws samples (modality, positions, media positions) to hit the workload's token mix."""

    workload: Workload
    rng: np.random.Generator
    counter: int = 0
    probs: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        w = self.workload
        probe = np.random.default_rng(0)
        total = sum(weight for _, weight in w.image_sources)
        for name, weight in w.image_sources:
            share = w.image_share * weight / total
            self.names.append(name)
            self.probs.append(share / _clipped_mean(name, w.seq_length, probe))
        self.names.append(w.text_source)
        self.probs.append((1 - w.image_share) / _clipped_mean(w.text_source, w.seq_length, probe))
        s = sum(self.probs)
        self.probs = [p / s for p in self.probs]

    def __call__(self) -> Segment:
        w = self.workload
        i = int(self.rng.choice(len(self.names), p=self.probs))
        modality, dist = PRESETS[self.names[i]]
        length = min(draw_length(dist, 1.0, self.rng), w.seq_length)
        self.counter += 1
        sid = f"{self.names[i]}/{self.counter:07d}"
        if modality == "text":  # longer texts are chunked by the loader; a chunk is a sample
            return Segment(sid, "text", 0, length, 0)
        length = max(length, 3)
        media = length - max(2, length - round(MEDIA_FRACTION * length))
        return Segment(sid, modality, 0, length, media)


def sample_sequences(
    workload: Workload, count: int, *, seed: int = 0, buffer: int = 64
) -> list[PackedSequence]:
    """``count`` packed sequences of the workload (best-fit over a ``buffer`` of samples).

    Returns real :class:`~omni_trainer.data.packing.PackedSequence` objects (without sample
    arrays), so the trainer's own helpers (``multiplex/workload.encoder_micro_batches``,
    ``components/model_flops``) read them.
    """
    draw = _Draw(workload, np.random.default_rng(seed))
    pending: list[Segment] = []
    out: list[PackedSequence] = []
    for _ in range(count):
        segments: list[Segment] = []
        offset = 0
        while True:
            while len(pending) < buffer:
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


def image_token_share(sequences: Sequence[PackedSequence]) -> float:
    """Measured image share of used positions (to check the sampler hits the mix)."""
    used = sum(s.used for s in sequences)
    image = sum(g.length for s in sequences for g in s.segments if g.modality == "image")
    return image / used if used else 0.0


def paper_workloads() -> dict[str, Workload]:
    """Workloads A-D as PAPER.md lists them (16K for A/B, 8K for C/D), image:text 5:5."""

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


def workload_from_config(cfg: TrainerConfig, *, world_size: int, name: str = "job") -> Workload:
    """A job manifest's trainer section as a planner workload (for ``omni plan --tune``).

    Image sources with a length preset keep their preset and weight; the image share is the first
    mixture point's image weight over image + text (audio and video are not planned yet).
    """
    data = cfg.data
    images = tuple(
        (s.preset, s.weight)
        for s in data.sources
        if s.modality == "image" and getattr(s, "preset", None) is not None
    )
    weights = data.mixture[0].weights
    image, text = weights.get("image", 0.0), weights.get("text", 0.0)
    return Workload(
        name=name,
        model=cfg.model,
        world_size=world_size,
        global_batch=data.global_batch_size,
        seq_length=data.seq_length,
        image_share=image / (image + text) if image + text else 0.0,
        image_sources=images or (("openimages", 1.0),),
    )
