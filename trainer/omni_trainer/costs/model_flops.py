"""Model FLOPs of a step from its packed sequences (torch-free: the planner uses it too)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from omni_trainer.costs.flops import matmul_flops, training_flops
from omni_trainer.models.config import ModelConfig


@dataclass(frozen=True)
class StepFlops:
    tokens: int  # LLM positions holding a sample (padding excluded)
    llm_forward: float
    encoder_forward: dict[str, float]

    @property
    def forward(self) -> float:
        return self.llm_forward + sum(self.encoder_forward.values())

    @property
    def training(self) -> float:
        return training_flops(self.forward)


def _segments(sequences) -> tuple[list[int], dict[str, list[int]]]:
    seg_lengths: list[int] = []
    media_lengths: dict[str, list[int]] = defaultdict(list)
    for seq in sequences:
        for seg in seq.segments:
            seg_lengths.append(seg.length)
            for modality, n in seg.media_lengths():
                media_lengths[modality].append(n)
    return seg_lengths, media_lengths


def llm_forward_flops(model: ModelConfig, sequences) -> float:
    """Forward FLOPs of the LLM over packed sequences (attention per packed sample)."""
    return model.llm.flops(_segments(sequences)[0])


def step_flops(model: ModelConfig, global_batch) -> StepFlops:
    """Model FLOPs of one global batch (the paper's convention: encoders
    counted, padding not).

    Attention is counted per packed sample because samples never attend to each other.
    """
    seg_lengths, media_lengths = _segments(global_batch)
    llm = model.llm
    encoder_forward = {}
    for modality, lengths in sorted(media_lengths.items()):
        enc = getattr(model.encoders, modality)
        # Projector (Linear enc->llm, GELU, Linear llm->llm) runs on every media token.
        projector = matmul_flops(sum(lengths), llm.hidden_size, enc.output_size + llm.hidden_size)
        encoder_forward[modality] = enc.flops(lengths) + projector
    return StepFlops(
        tokens=sum(seg_lengths),
        llm_forward=llm_forward_flops(model, global_batch),
        encoder_forward=encoder_forward,
    )
