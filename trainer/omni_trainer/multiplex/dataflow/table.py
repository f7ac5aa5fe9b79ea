"""The dataflow table: for each encoder micro-batch its forward and backward slot, with the
paper's notation, a JSON form, and the encoder activations each stage holds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final, Literal

from omni_trainer.multiplex.dataflow.schedule import DataflowError, LLMOp, stage_ops

__all__ = [
    "POST",
    "PRE",
    "DataflowTable",
    "Direction",
    "EncoderMicroBatch",
    "Slot",
    "from_paper_notation",
    "peak_live",
    "stage_peaks",
]

PRE: Final = -1
"""Slot index before megatron's schedule starts (forwards only in a valid table)."""
POST: Final = 2**31 - 1
"""Slot index after the stage's last op, in finalize (backwards only in a valid table)."""

Direction = Literal["forward", "backward"]


@dataclass(frozen=True)
class EncoderMicroBatch:
    """The media of one modality of one LLM micro-batch; ``cost`` is its forward time in units of
    one LLM forward op (its backward costs ``b/f`` times that); ``activations`` what its forward
    keeps for its backward (bytes, or any unit the memory budget shares; None: ``cost`` stands
    for it, activations and FLOPs both growing with the tokens encoded)."""

    id: int
    microbatch: int
    modality: str = "image"
    cost: float = 1.0
    activations: float | None = None

    @property
    def memory(self) -> float:
        """Activations held from forward to backward, in the memory budget's unit."""
        return self.cost if self.activations is None else self.activations

    def describe(self) -> str:
        """``encoder mb 3 (image of micro-batch 1)``, for messages."""
        return f"encoder mb {self.id} ({self.modality} of micro-batch {self.microbatch})"


@dataclass(frozen=True, order=True)
class Slot:
    """A place on ``stage`` for encoder work: ``index`` = PRE (-1), 0..n-1 (just before the
    stage's index-th forward op) or POST (after the stage's last op)."""

    stage: int
    index: int

    @property
    def is_pre(self) -> bool:
        """Before megatron's schedule starts."""
        return self.index == PRE

    @property
    def is_post(self) -> bool:
        """After megatron's schedule ends (finalize)."""
        return self.index == POST


@dataclass(frozen=True)
class DataflowTable:
    """The joint schedule: for each encoder micro-batch (by id) its forward and backward slot.

    Treat ``forward``/``backward`` as read-only (plain dicts so the table pickles and serializes).
    """

    pp: int
    vpp: int
    num_microbatches: int
    encoder_mbs: tuple[EncoderMicroBatch, ...]
    forward: dict[int, Slot]
    backward: dict[int, Slot]
    policy: str = field(default="manual", compare=False)

    @property
    def num_forward_ops(self) -> int:
        """Forward ops per stage (valid slot indices are 0..this-1, PRE and POST)."""
        return self.num_microbatches * self.vpp

    @cached_property
    def _by_id(self) -> dict[int, EncoderMicroBatch]:
        return {e.id: e for e in self.encoder_mbs}

    def mb(self, mb_id: int) -> EncoderMicroBatch:
        """The encoder micro-batch with that id."""
        try:
            return self._by_id[mb_id]
        except KeyError:
            raise KeyError(f"no encoder micro-batch with id {mb_id}") from None

    def ops(self, stage: int) -> list[LLMOp]:
        """This stage's LLM ops in megatron's order."""
        return stage_ops(
            stage=stage, pp=self.pp, vpp=self.vpp, num_microbatches=self.num_microbatches
        )

    def at(self, stage: int, index: int, direction: Direction) -> list[int]:
        """Encoder mb ids to run at this slot, in execution order (micro-batch, then id)."""
        slots = self.forward if direction == "forward" else self.backward
        ids = [i for i, s in slots.items() if s.stage == stage and s.index == index]
        return sorted(ids, key=lambda i: (self.mb(i).microbatch, i))

    def stage_cost(self, stage: int) -> float:
        """Sum of encoder forward costs placed on ``stage`` (the load the planners balance)."""
        return sum(e.cost for e in self.encoder_mbs if self.forward[e.id].stage == stage)

    def describe_slot(self, slot: Slot) -> str:
        """``before F(2)``, ``at PRE (before the schedule)``, ``at POST (after the schedule)``."""
        if slot.is_pre:
            return "at PRE (before the schedule)"
        if slot.is_post:
            return "at POST (after the schedule)"
        fwd = [op for op in self.ops(slot.stage) if op.kind == "F"]
        return f"before {fwd[slot.index].label(self.vpp)}"

    def neighbours(self, slot: Slot) -> tuple[LLMOp | None, LLMOp | None]:
        """The LLM ops just before and just after ``slot`` on its stage (None at the edges)."""
        ops = self.ops(slot.stage)
        if slot.is_pre:
            return None, ops[0]
        if slot.is_post:
            return ops[-1], None
        pos = [p for p, op in enumerate(ops) if op.kind == "F"][slot.index]
        return (ops[pos - 1] if pos else None), ops[pos]

    def paper_notation(self) -> dict[int, tuple[int, list[int | None]]]:
        """The paper's ``{encoder_mb: (pp_rank, [left, right])}``.

        Keys: ``id`` for an encoder forward, ``-(id + 1)`` for its backward. ``left``/``right``
        are the LLM ops around the slot on that stage as signed micro-batches (``+(m+1)``
        forward, ``-(m+1)`` backward, chunk not written); ``left`` is None when the slot is before
        the stage's first op. Slots outside megatron's schedule are ``[None, None]``: PRE for a
        forward key, POST for a backward key. With vpp > 1 the pair can be ambiguous (the chunk is
        dropped); the table's :class:`Slot` stays authoritative.
        """
        out: dict[int, tuple[int, list[int | None]]] = {}
        for e in sorted(self.encoder_mbs, key=lambda e: e.id):
            for key, slot, outside in (
                (e.id, self.forward[e.id], self.forward[e.id].is_pre),
                (-(e.id + 1), self.backward[e.id], self.backward[e.id].is_post),
            ):
                if outside:
                    out[key] = (slot.stage, [None, None])
                    continue
                left, right = self.neighbours(slot)
                out[key] = (
                    slot.stage,
                    [left.signed if left else None, right.signed if right else None],
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (PRE/POST written as strings)."""

        def idx(s: Slot) -> int | str:
            return "PRE" if s.is_pre else "POST" if s.is_post else s.index

        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "num_microbatches": self.num_microbatches,
            "policy": self.policy,
            "encoder_mbs": [
                {
                    "id": e.id,
                    "microbatch": e.microbatch,
                    "modality": e.modality,
                    "cost": e.cost,
                    "activations": e.activations,
                    "stage": self.forward[e.id].stage,
                    "forward": idx(self.forward[e.id]),
                    "backward": idx(self.backward[e.id]),
                }
                for e in sorted(self.encoder_mbs, key=lambda e: e.id)
            ],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> DataflowTable:
        """Inverse of :meth:`to_dict`."""

        def idx(v: int | str) -> int:
            return PRE if v == "PRE" else POST if v == "POST" else int(v)

        mbs = doc["encoder_mbs"]
        return cls(
            pp=doc["pp"],
            vpp=doc["vpp"],
            num_microbatches=doc["num_microbatches"],
            encoder_mbs=tuple(
                EncoderMicroBatch(
                    d["id"], d["microbatch"], d["modality"], d["cost"], d.get("activations")
                )
                for d in mbs
            ),
            forward={d["id"]: Slot(d["stage"], idx(d["forward"])) for d in mbs},
            backward={d["id"]: Slot(d["stage"], idx(d["backward"])) for d in mbs},
            policy=doc.get("policy", "manual"),
        )


def from_paper_notation(
    notation: Mapping[int, tuple[int, Sequence[int | None]]],
    *,
    pp: int,
    vpp: int,
    num_microbatches: int,
    encoder_mbs: Iterable[EncoderMicroBatch],
) -> DataflowTable:
    """Rebuild a table from :meth:`DataflowTable.paper_notation`; raises where a pair is ambiguous
    (vpp > 1) or names no slot."""
    mbs = tuple(encoder_mbs)
    proto = DataflowTable(pp, vpp, num_microbatches, mbs, {}, {})
    n = proto.num_forward_ops

    def find(stage: int, pair: Sequence[int | None], backward: bool) -> Slot:
        left, right = pair
        if left is None and right is None:
            return Slot(stage, POST if backward else PRE)
        hits = []
        for i in range(n):
            lo, ro = proto.neighbours(Slot(stage, i))
            if (lo.signed if lo else None) == left and ro is not None and ro.signed == right:
                hits.append(i)
        if len(hits) != 1:
            what = "no slot" if not hits else f"{len(hits)} slots"
            raise DataflowError(f"[{left}, {right}] on stage {stage} names {what}")
        return Slot(stage, hits[0])

    fwd = {e.id: find(*notation[e.id], backward=False) for e in mbs}
    bwd = {e.id: find(*notation[-(e.id + 1)], backward=True) for e in mbs}
    return DataflowTable(pp, vpp, num_microbatches, mbs, fwd, bwd)


def peak_live(live: Sequence[tuple[int, int, float]], lo: int, hi: int) -> float:
    """Peak of the activations held at slots ``lo <= s < hi`` of one stage, each entry
    ``(forward index, backward index, memory)`` held from its forward slot until its backward slot
    (a slot runs its backwards first, so memory freed there is reused by its forwards)."""
    points = [lo, *(f for f, _, _ in live if lo < f < hi)]
    return max((sum(m for f, b, m in live if f <= s < b) for s in points), default=0.0)


def stage_peaks(table: DataflowTable, *, skip: int | None = None) -> list[float]:
    """Per stage, the peak of its live encoder activations (see :func:`peak_live`), without
    mb ``skip``."""
    live: list[list[tuple[int, int, float]]] = [[] for _ in range(table.pp)]
    for e in table.encoder_mbs:
        if e.id != skip:
            fs, bs = table.forward[e.id], table.backward[e.id]
            live[fs.stage].append((fs.index, bs.index, e.memory))
    return [peak_live(x, PRE, POST) for x in live]
