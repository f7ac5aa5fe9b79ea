"""The multimodal model: one encoder + projector per modality feeding megatron's GPTModel."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from omni_trainer.models.config import ModelConfig
from omni_trainer.models.llm import build_gpt_chunks


@dataclass
class MediaBatch:
    """All items of one modality in a micro-batch, in order, and where their tokens go."""

    arrays: list[torch.Tensor]
    flat_positions: torch.Tensor  # [sum(tokens)] index into the [s*b] flattened LLM input
    rows: torch.Tensor | None = None
    """Which rows of the encoder outputs go to ``flat_positions`` (None: all); with context
    parallelism a rank keeps only the rows of the positions it holds."""


@dataclass
class DeviceBatch:
    """A micro-batch on the device, in the shapes megatron expects."""

    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] float
    position_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [b, 1, s, s] bool, True = may NOT attend (CP: see
    # models.context_parallel.shard_for_context)
    media: dict[str, MediaBatch]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def segment_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention that never crosses a packed sample's boundary ([b,1,s,s], True = masked)."""
    s = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return ~(same & causal)[:, None]


def build_encoder(modality: str, cfg) -> nn.Module:
    """An encoder whose token mixing can switch to Ulysses sequence parallelism per sample."""
    from omni_trainer.multiplex.ulysses import UlyssesMixer

    if modality == "image":
        from omni_trainer.models.encoders.vision import VisionEncoder

        return VisionEncoder(cfg, mixer=UlyssesMixer())
    if modality == "audio":
        from omni_trainer.models.encoders.audio import AudioEncoder

        return AudioEncoder(cfg, mixer=UlyssesMixer())
    raise ValueError(f"no encoder for modality {modality!r}")


class OmniModel(nn.Module):
    """This rank's parts of the multimodal model: its LLM chunks, and every encoder + projector.

    Encoders sit on every pipeline stage (the paper's colocated layout), so every rank holds a
    full replica of each. All weights are layout-independent functions of the seed.
    """

    def __init__(self, cfg: ModelConfig, *, max_sequence_length: int, seed: int) -> None:
        super().__init__()
        from omni_trainer.models.encoders.projector import Projector
        from omni_trainer.models.freeze import apply_freeze
        from omni_trainer.models.init import name_seed

        self.cfg = cfg
        self.llm_chunks = nn.ModuleList(
            build_gpt_chunks(cfg.llm, max_sequence_length=max_sequence_length, seed=seed)
        )
        torch.manual_seed(name_seed(seed, "encoders"))
        self.encoders = nn.ModuleDict()
        self.projectors = nn.ModuleDict()
        for modality in ("image", "audio"):
            enc_cfg = getattr(cfg.encoders, modality)
            if enc_cfg is None:
                continue
            self.encoders[modality] = build_encoder(modality, enc_cfg)
            self.projectors[modality] = Projector(enc_cfg.hidden_size, cfg.llm.hidden_size)
        apply_freeze(self, cfg)

    def llm_parameters(self) -> list[nn.Parameter]:
        return list(self.llm_chunks.parameters())

    def encoder_parameters(self) -> list[nn.Parameter]:
        return [*self.encoders.parameters(), *self.projectors.parameters()]


def first_stage_input(
    chunk: nn.Module, batch: DeviceBatch, media: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Text embeddings with every media span replaced by its projected encoder output."""
    emb = chunk.embedding(input_ids=batch.tokens, position_ids=batch.position_ids)
    s, b, h = emb.shape
    flat = emb.reshape(s * b, h)
    for modality, encoded in sorted(media.items()):
        target = batch.media[modality]
        if target.rows is not None:
            encoded = encoded.index_select(0, target.rows)
        flat = flat.index_copy(0, target.flat_positions, encoded.to(flat.dtype))
    return flat.reshape(s, b, h)


def to_device_batch(
    mb, device: torch.device, *, load: Callable, media: Collection[str] = ()
) -> DeviceBatch:
    """Move a collated numpy micro-batch (``omni_trainer.data``) to ``device``.

    Args:
        mb: the micro-batch; its media items are references.
        device: where the tensors go.
        load: reads a media reference into an ndarray (``data.MediaReader.load``).
        media: the modalities whose media this rank encodes (the zero-redundancy filter): only
            those are loaded and moved; the positions of every modality's tokens always are.
    """
    b = mb.tokens.shape[0]
    segment_ids = torch.as_tensor(mb.segment_ids, device=device)
    per_modality: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for item in mb.media:
        arrays, positions = per_modality.setdefault(item.modality, ([], []))
        if item.modality in media:
            arrays.append(torch.as_tensor(load(item.ref), device=device))
        seq_pos = torch.arange(item.offset, item.offset + item.num_tokens, device=device)
        positions.append(seq_pos * b + item.row)  # [s, b] flattened row-major
    return DeviceBatch(
        tokens=torch.as_tensor(mb.tokens, device=device),
        labels=torch.as_tensor(mb.labels, device=device),
        loss_mask=torch.as_tensor(mb.loss_mask, device=device),
        position_ids=torch.as_tensor(mb.position_ids, device=device),
        attention_mask=segment_attention_mask(segment_ids),
        media={
            m: MediaBatch(arrays=arrays, flat_positions=torch.cat(positions))
            for m, (arrays, positions) in sorted(per_modality.items())
        },
    )
