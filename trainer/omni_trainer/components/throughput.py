"""FLOPs of a training step and the peak they are measured against (MFU)."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni_trainer.components.flops import (
    detect_peak_flops,
    matmul_flops,
    measure_peak_flops,
    training_flops,
    transformer_flops,
)
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


def step_flops(model: ModelConfig, global_batch) -> StepFlops:
    """Model FLOPs of one global batch (PAPER.md convention: encoders counted, padding not).

    Attention is counted per packed sample because samples never attend to each other.
    """
    seg_lengths: list[int] = []
    media_lengths: dict[str, list[int]] = defaultdict(list)
    for seq in global_batch:
        for seg in seq.segments:
            seg_lengths.append(seg.length)
            if seg.media_tokens:
                media_lengths[seg.modality].append(seg.media_tokens)
    llm = model.llm
    llm_forward = transformer_flops(
        num_layers=llm.num_layers,
        hidden_size=llm.hidden_size,
        ffn_hidden_size=llm.ffn_hidden_size,
        num_heads=llm.num_attention_heads,
        num_query_groups=llm.num_query_groups,
        gated_mlp=llm.gated_mlp,
        vocab_size=llm.vocab_size,
        seq_lengths=seg_lengths,
    )
    encoder_forward = {}
    for modality, lengths in sorted(media_lengths.items()):
        enc = getattr(model.encoders, modality)
        # Projector (Linear enc->llm, GELU, Linear llm->llm) runs on every media token.
        projector = matmul_flops(sum(lengths), llm.hidden_size, enc.hidden_size + llm.hidden_size)
        encoder_forward[modality] = enc.flops(lengths) + projector
    return StepFlops(
        tokens=sum(seg_lengths), llm_forward=llm_forward, encoder_forward=encoder_forward
    )


def measure_cpu_peak_flops(n: int = 2048) -> float:
    """fp32 matmul FLOP/s of this machine with all its cores (no datasheet exists for a CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        return measure_peak_flops(lambda: a @ b, flops_per_call=matmul_flops(n, n, n), iters=5)
    finally:
        torch.set_num_threads(threads)


def resolve_peak_flops(
    device: torch.device, *, world_size: int, override_per_device: float | None
) -> tuple[float, str]:
    """The job's peak FLOP/s and its source.

    GPUs: datasheet (or configured) peak per device x world size. CPU: every local rank shares one
    machine, so the peak is the machine's measured fp32 matmul rate (or the configured figure),
    measured on rank 0 and broadcast so all ranks report the same MFU.
    """
    if device.type == "cuda":
        per_device, source = detect_peak_flops(
            torch.cuda.get_device_name(device), override=override_per_device
        )
        return per_device * world_size, f"{source} x {world_size} devices"
    if override_per_device is not None:
        return float(override_per_device), "configured (machine)"
    measured = torch.zeros(1, dtype=torch.float64)
    if not dist.is_initialized() or dist.get_rank() == 0:
        measured[0] = measure_cpu_peak_flops()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(measured, src=0)
    return float(measured.item()), "measured fp32 matmul, whole CPU"
