"""A micro-batch on the device as megatron takes it, and where its media tokens go."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class MediaBatch:
    """All items of one modality in a micro-batch, in order, and where their tokens go."""

    arrays: list[torch.Tensor]
    flat_positions: torch.Tensor  # [sum(tokens)] index into the packed row of LLM tokens
    rows: torch.Tensor | None = None
    """Which rows of the encoder outputs go to ``flat_positions`` (None: all); with context
    parallelism a rank keeps only the rows of the positions it holds."""


@dataclass
class MediaRows:
    """Projected encoder outputs of one modality that stage 0 writes into its input: all of them
    in item order (``positions`` None: where ``MediaBatch.flat_positions`` says), or with
    sequence parallelism the rows of this rank's shard and their ``positions`` in it."""

    encoded: torch.Tensor
    positions: torch.Tensor | None = None


@dataclass
class DeviceBatch:
    """A micro-batch on the device as one packed row ``[1, t]`` (``t`` = micro-batch size x
    sequence length, or this rank's share of it under context parallelism), its samples
    delimited by ``packed_seq_params`` (``models.packed``; no dense attention mask exists)."""

    tokens: torch.Tensor  # [1, t]
    labels: torch.Tensor  # [1, t]
    loss_mask: torch.Tensor  # [1, t] float
    position_ids: torch.Tensor  # [1, t], restarting in every sample; M-RoPE: [3, 1, t]
    packed_seq_params: PackedSeqParams
    media: dict[str, MediaBatch]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def llm_sequence_shape(seq_length: int, micro_batch_size: int) -> dict[str, int]:
    """megatron schedule's ``seq_length`` / ``micro_batch_size`` of a packed micro-batch: one row
    of all its tokens (pipeline buffers ``[t, 1, hidden]``; megatron divides ``t`` by the CP
    size itself, megatron-core 0.16.1 ``schedules.get_tensor_shapes``)."""
    return {"seq_length": seq_length * micro_batch_size, "micro_batch_size": 1}


def media_positions(mb) -> dict[str, np.ndarray]:
    """Per modality, the packed-row position of each media token of micro-batch ``mb`` (items
    in order, row-major in the packed row)."""
    s = mb.tokens.shape[1]
    runs: dict[str, list[np.ndarray]] = {}
    for item in mb.media:
        start = item.row * s + item.offset
        runs.setdefault(item.modality, []).append(np.arange(start, start + item.num_tokens))
    return {m: np.concatenate(r) for m, r in runs.items()}


def to_device_batch(
    mb, device: torch.device, *, load: Callable, media: Collection[str] = ()
) -> DeviceBatch:
    """Move a collated numpy micro-batch (``omni_trainer.data``) to ``device`` as one packed row.

    Args:
        mb: the micro-batch; its media items are references.
        device: where the tensors go.
        load: reads a media reference into an ndarray (``data.MediaReader.load``).
        media: the modalities whose media this rank encodes (the zero-redundancy filter): only
            those are loaded and moved; the positions of every modality's tokens always are.
    """
    from omni_trainer.models.packed import pack_boundaries

    arrays: dict[str, list[torch.Tensor]] = {}
    for item in mb.media:
        mine = arrays.setdefault(item.modality, [])
        if item.modality in media:
            mine.append(torch.as_tensor(load(item.ref), device=device))

    def row(a) -> torch.Tensor:
        return torch.as_tensor(a, device=device).reshape(1, -1)

    return DeviceBatch(
        tokens=row(mb.tokens),
        labels=row(mb.labels),
        loss_mask=row(mb.loss_mask),
        position_ids=torch.as_tensor(mb.position_ids, device=device).reshape(
            *mb.position_ids.shape[:-2], 1, -1
        ),
        packed_seq_params=pack_boundaries(mb.segment_ids, device),
        media={
            m: MediaBatch(
                arrays=arrays[m], flat_positions=torch.as_tensor(positions, device=device)
            )
            for m, positions in sorted(media_positions(mb).items())
        },
    )
