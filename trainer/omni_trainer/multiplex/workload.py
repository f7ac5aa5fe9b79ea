"""From packed micro-batches to encoder micro-batches with costs: shared by trainer and planner.

Torch-free, so ``omni plan`` can show a job's dataflow table without building a model.
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_trainer.costs.activation_bytes import kept_bytes_per_token
from omni_trainer.costs.model_flops import llm_forward_flops
from omni_trainer.data.packing import PackedSequence
from omni_trainer.models.config import ModelConfig
from omni_trainer.multiplex.dataflow.table import DataflowTable, EncoderMicroBatch


def encoder_micro_batches(
    model: ModelConfig, micro_batches: Sequence[Sequence[PackedSequence]], *, stages: int
) -> tuple[list[EncoderMicroBatch], dict[int, list[int]]]:
    """One encoder micro-batch per (LLM micro-batch, modality with media), in that order.

    Args:
        model: shapes, for the FLOPs of encoders and LLM.
        micro_batches: one replica's micro-batches, each a list of packed sequences.
        stages: pipeline stages x virtual stages; an LLM forward op is one micro-batch on one
            model chunk, the planner's time unit.

    Returns:
        The encoder micro-batches (cost in LLM forward ops, activations in bytes kept for the
        backward: all of the mb's tokens, the bound for the busiest LSSP rank) and, per id, the
        encoder token count of each media item in packing order (the order ``collate`` lists
        them in).
    """
    llm = [llm_forward_flops(model, seqs) for seqs in micro_batches]
    unit = max(sum(llm) / max(len(llm), 1) / stages, 1.0)
    mbs: list[EncoderMicroBatch] = []
    lengths: dict[int, list[int]] = {}
    for m, seqs in enumerate(micro_batches):
        per_modality: dict[str, list[int]] = {}
        for seq in seqs:
            for seg in seq.segments:
                for modality, n in seg.media_lengths():
                    per_modality.setdefault(modality, []).append(n)
        for modality, items in sorted(per_modality.items()):
            e = len(mbs)
            lengths[e] = items
            enc = getattr(model.encoders, modality)
            kept = kept_bytes_per_token(enc.hidden_size, enc.num_layers) * sum(items)
            mbs.append(EncoderMicroBatch(e, m, modality, enc.flops(items) / unit, kept))
    return mbs, lengths


def media_encoded_on(table: DataflowTable, stage: int) -> dict[int, set[str]]:
    """Per LLM micro-batch, the modalities whose media ``stage`` encodes (its only media need:
    the zero-redundancy filter)."""
    out: dict[int, set[str]] = {}
    for mb in table.encoder_mbs:
        if table.forward[mb.id].stage == stage:
            out.setdefault(mb.microbatch, set()).add(mb.modality)
    return out
