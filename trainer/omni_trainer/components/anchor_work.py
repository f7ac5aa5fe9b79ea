"""What the encoder anchor works on in one step: each encoder micro-batch's LSSP plan and its
pieces, where each piece goes on stage 0, and the sends and tensors in flight on this rank.

A piece is one token range of one item that one rank of the stage's group encodes
(``balance.lssp``); pieces are consumed in item order, then token order. Every message of the
anchor carries a tag naming its encoder micro-batch, piece and direction (gloo matches by tag).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from omni_trainer.balance.lssp import LSSPPlan, TokenRange, plan_lssp
from omni_trainer.multiplex.dataflow.table import DataflowTable, EncoderMicroBatch
from omni_trainer.multiplex.reshard import Part, plan_parts

Held = tuple[int | None, int, torch.Tensor, bool]
"""An encoder output kept for its backward: (piece index or None, item, output, long?); an
empty shard of a long sample has no piece but still joins its group's backward collectives."""


def message_tag(emb: int, piece: int, direction: int) -> int:
    """The tag of piece ``piece`` of encoder micro-batch ``emb`` going ``direction``."""
    return ((emb * 4096 + piece) << 1) | direction


@dataclass
class EncoderWork:
    """One encoder micro-batch: the media of one modality of one LLM micro-batch."""

    mb: EncoderMicroBatch
    arrays: list[torch.Tensor]
    plan: LSSPPlan
    pieces: list[TokenRange] = field(init=False)  # consumption order: item, then token range
    items: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pieces, self.items = [], []
        for item, ranges in enumerate(self.plan.placement):
            for r in ranges:
                if r.stop > r.start:
                    self.pieces.append(r)
                    self.items.append(item)


def build_works(
    encoder_mbs: list[EncoderMicroBatch],
    arrays: dict[int, list[torch.Tensor]],
    lengths: dict[int, list[int]],
    *,
    eta: int,
    group_size: int,
    cost: Callable[[str, int], float],
) -> list[EncoderWork]:
    """The LSSP plan of every encoder micro-batch (identical on every rank of the replica)."""
    return [
        EncoderWork(
            mb=mb,
            arrays=arrays[mb.id],
            plan=plan_lssp(
                lengths[mb.id],
                eta=eta,
                group_size=group_size,
                cost=lambda n, m=mb.modality: cost(m, n),
            ),
        )
        for mb in encoder_mbs
    ]


@dataclass
class AnchorStep:
    """One step's encoder work on this rank and what is in flight for it.

    Attributes:
        sequence_shard: positions per stage-0 TP rank under sequence parallelism (each rank
            receives only its rows); None: every stage-0 TP rank takes whole pieces.
        tp: the stage-0 tensor-parallel size.
    """

    sequence_shard: int | None
    tp: int
    table: DataflowTable | None = None
    works: dict[int, EncoderWork] = field(default_factory=dict)
    by_microbatch: dict[int, list[int]] = field(default_factory=dict)
    """Encoder micro-batches per LLM micro-batch, in table order."""
    sends: list[dist.Work] = field(default_factory=list)
    held: dict[int, list[Held]] = field(default_factory=dict)
    local_outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(emb, piece) outputs this rank encoded for itself on stage 0."""
    local_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(emb, piece) gradients this rank returns to itself."""
    pending_grads: dict[int, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    """Per LLM micro-batch: the embedding gradients arrived so far."""
    parts: dict[tuple[int, int], list[Part]] = field(default_factory=dict)

    @classmethod
    def plan(
        cls,
        table: DataflowTable,
        works: list[EncoderWork],
        positions: Sequence[dict[str, np.ndarray]],
        *,
        sequence_shard: int | None,
        tp: int,
    ) -> AnchorStep:
        """The step of ``works`` under ``table``; ``positions``: per LLM micro-batch, each
        modality's media token positions in the packed row, needed with ``sequence_shard``."""
        step = cls(sequence_shard=sequence_shard, tp=tp, table=table)
        step.works = {w.mb.id: w for w in works}
        for w in works:
            step.by_microbatch.setdefault(w.mb.microbatch, []).append(w.mb.id)
        if sequence_shard is not None:
            for m, embs in step.by_microbatch.items():
                pieces = [
                    ((emb, idx), step.works[emb].mb.modality, piece.stop - piece.start)
                    for emb in embs
                    for idx, piece in enumerate(step.works[emb].pieces)
                ]
                step.parts |= plan_parts(pieces, positions[m], shard=sequence_shard)
        return step

    def parts_of(self, emb: int, idx: int) -> list[Part]:
        """Where piece ``idx`` of ``emb`` goes on stage 0: with sequence parallelism the rows
        each TP rank keeps; without, the whole piece to every TP rank."""
        if self.sequence_shard is not None:
            return self.parts[(emb, idx)]
        piece = self.works[emb].pieces[idx]
        return [Part(t, 0, piece.stop - piece.start, 0) for t in range(self.tp)]

    def grad_parts(self, emb: int, idx: int) -> list[Part]:
        """Who returns the piece's gradient: each part's rank (sequence parallel), or one of
        the identical whole copies (by piece, to spread the traffic)."""
        parts = self.parts_of(emb, idx)
        return parts if self.sequence_shard is not None else [parts[idx % self.tp]]
