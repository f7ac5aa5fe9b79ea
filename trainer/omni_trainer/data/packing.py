"""Hybrid packing: samples of all modalities, best-fit into fixed-length sequences, then collated.

Best fit from a buffer keeps sequences full (little padding) without sorting the whole stream, and
the buffer is small enough to checkpoint as sample keys. Media is never split; only text-only
samples longer than a sequence arrive here as chunks (see ``sample.split_text``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from omni_trainer.data.config import Modality
from omni_trainer.data.sample import MediaRef, Sample


@dataclass(frozen=True)
class Segment:
    """Where one sample sits in its packed sequence (media first, then text)."""

    sample_id: str
    modality: Modality
    offset: int
    length: int
    media_tokens: int
    items: tuple[tuple[Modality, int], ...] = ()
    """(modality, positions) of the media inside the text (``Sample.spans``), in order."""

    def media_lengths(self) -> list[tuple[Modality, int]]:
        """Every media item of the segment as (modality, positions), in ``collate``'s order."""
        head = [(self.modality, self.media_tokens)] if self.media_tokens else []
        return head + list(self.items)


@dataclass(frozen=True)
class PackedSequence:
    """One LLM sequence: segments in order, the samples behind them, then padding."""

    seq_length: int
    segments: list[Segment]
    samples: list[Sample]

    @property
    def used(self) -> int:
        """Positions taken by samples (the rest is padding)."""
        return sum(s.length for s in self.segments)


class Packer:
    """Best-fit packer over a buffer of ``buffer_size`` samples."""

    def __init__(self, seq_length: int, buffer_size: int) -> None:
        self.seq_length = seq_length
        self.buffer_size = buffer_size
        self.buffer: list[Sample] = []

    def pack(self, draw: Callable[[], Sample]) -> PackedSequence:
        """Fill one sequence: repeatedly take the largest buffered sample that fits, refilling."""
        segments: list[Segment] = []
        samples: list[Sample] = []
        offset = 0
        while True:
            while len(self.buffer) < self.buffer_size:
                self.buffer.append(self._checked(draw()))
            room = self.seq_length - offset
            best = -1
            for i, s in enumerate(self.buffer):
                fits = s.num_tokens <= room
                if fits and (best < 0 or s.num_tokens > self.buffer[best].num_tokens):
                    best = i
            if best < 0:
                break
            s = self.buffer.pop(best)
            items = tuple((sp.modality, sp.tokens) for sp in s.spans)
            segments.append(
                Segment(s.sample_id, s.modality, offset, s.num_tokens, s.media_tokens, items)
            )
            samples.append(s)
            offset += s.num_tokens
            if offset == self.seq_length:
                break
        return PackedSequence(self.seq_length, segments, samples)

    def _checked(self, s: Sample) -> Sample:
        if s.num_tokens > self.seq_length or s.num_tokens < 1:
            raise ValueError(
                f"sample {s.sample_id} has {s.num_tokens} tokens; "
                f"packing needs 1..{self.seq_length}"
            )
        return s


@dataclass(frozen=True)
class MediaItem:
    """Media to encode and place at ``tokens[row, offset : offset + num_tokens]``."""

    modality: Modality
    row: int
    offset: int
    num_tokens: int
    ref: MediaRef
    """Loaded only where it is encoded."""
    sample_id: str


@dataclass(frozen=True)
class MicroBatch:
    """Numpy tensors of one micro-batch; the trainer turns them into torch tensors."""

    tokens: np.ndarray
    """[b, s] int64 text ids; 0 at media and padding positions."""
    labels: np.ndarray
    """[b, s] int64: ``tokens[:, i + 1]`` (0 in the last column)."""
    loss_mask: np.ndarray
    """[b, s] float32: 1 iff position i+1 is a text target (every text token, or the sample's
    ``targets``: assistant turns) of the same segment as i."""
    segment_ids: np.ndarray
    """[b, s] int32 segment index within the row, -1 on padding; attention stays inside."""
    position_ids: np.ndarray
    """[b, s] int64, restarting at 0 for every segment (0 on padding); M-RoPE models replace
    it by [3, b, s] (``interop.qwen2_5_vl.batch_positions``)."""
    media: list[MediaItem] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)

    @property
    def num_loss_tokens(self) -> int:
        """Positions that contribute to the loss."""
        return int(self.loss_mask.sum())


def collate(sequences: Sequence[PackedSequence], seq_length: int) -> MicroBatch:
    """Stack packed sequences into a :class:`MicroBatch` (media first in each segment)."""
    b = len(sequences)
    tokens = np.zeros((b, seq_length), dtype=np.int64)
    is_text = np.zeros((b, seq_length), dtype=bool)
    segment_ids = np.full((b, seq_length), -1, dtype=np.int32)
    position_ids = np.zeros((b, seq_length), dtype=np.int64)
    media: list[MediaItem] = []
    sample_ids: list[str] = []
    for row, seq in enumerate(sequences):
        if seq.seq_length != seq_length:
            raise ValueError(f"sequence {row} has seq_length {seq.seq_length}, not {seq_length}")
        for j, (seg, s) in enumerate(zip(seq.segments, seq.samples, strict=True)):
            o, n, m = seg.offset, seg.length, seg.media_tokens
            segment_ids[row, o : o + n] = j
            position_ids[row, o : o + n] = np.arange(n)
            tokens[row, o + m : o + n] = s.text
            is_text[row, o + m : o + n] = True if s.targets is None else s.targets
            sample_ids.append(seg.sample_id)
            if s.media is not None:
                media.append(MediaItem(seg.modality, row, o, m, s.media, seg.sample_id))
            for sp in s.spans:
                at = o + m + sp.offset
                media.append(MediaItem(sp.modality, row, at, sp.tokens, sp.ref, seg.sample_id))
    labels = np.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = np.zeros((b, seq_length), dtype=np.float32)
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] >= 0)
    loss_mask[:, :-1] = (same & is_text[:, 1:]).astype(np.float32)
    return MicroBatch(tokens, labels, loss_mask, segment_ids, position_ids, media, sample_ids)


def split_micro_batches(
    sequences: Sequence[PackedSequence], micro_batch_size: int
) -> list[list[PackedSequence]]:
    """Consecutive groups of ``micro_batch_size`` sequences (must divide evenly)."""
    if micro_batch_size < 1 or len(sequences) % micro_batch_size:
        raise ValueError(
            f"micro_batch_size {micro_batch_size} must be >= 1 and divide "
            f"{len(sequences)} sequences"
        )
    return [
        list(sequences[i : i + micro_batch_size])
        for i in range(0, len(sequences), micro_batch_size)
    ]
