"""A micro-batch on the device as megatron takes it, and where its media tokens go."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch


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
