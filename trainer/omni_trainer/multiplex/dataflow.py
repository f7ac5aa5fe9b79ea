"""The dataflow table: where each encoder micro-batch runs inside megatron's pipeline schedule.

EncoderAnchor (the paper's techniques 5-6) inserts encoder work into the LLM pipeline without
editing megatron-core.
This module is the one description of that joint schedule, shared by the runtime,
the planner (``omni plan``) and the simulator, so it is pure Python (no torch).

Vocabulary
----------
- LLM op: ``F``/``B`` of (micro-batch ``m``, model chunk ``c``) as megatron-core 0.16.1 runs them on
  one pipeline stage (:func:`stage_ops`).
- Slot ``(stage, index)``: a place on one stage where encoder work may run. ``index`` counts that
  stage's FORWARD ops: ``i`` in ``0..n-1`` (``n = num_microbatches * vpp``) is inside megatron's
  i-th ``forward_step_func`` call of the stage, just before the LLM forward; on a stage > 0 (and on
  stage 0 for chunks > 0) megatron has already received that op's input activation, so the slot
  comes after the op's cross-stage dependency. :data:`PRE` (-1) runs before megatron's schedule is
  called, :data:`POST` (a large sentinel, sorts after every index) after it ends (in the wrapped
  ``finalize_model_grads_func``). Within one slot encoder backwards run before encoder forwards,
  each group in ascending (LLM micro-batch, id) order.
- An encoder micro-batch (one modality's media of one LLM micro-batch) runs its forward at one slot
  and its backward at a later slot of the SAME stage (its activations live there). Its output goes
  to stage 0, which consumes it at F(m, 0); its gradient comes back from stage 0's B(m, 0).

Validity is acyclicity of a happens-before graph (:func:`validate_dataflow`). Sends are modelled as
non-blocking (buffered); only receives (and program order) create edges.
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final, Literal

__all__ = [
    "HEADROOM",
    "POLICIES",
    "POST",
    "PRE",
    "DataflowError",
    "DataflowTable",
    "Direction",
    "EncoderMicroBatch",
    "LLMOp",
    "Slot",
    "check_layout",
    "format_dataflow",
    "from_paper_notation",
    "plan_dataflow",
    "simulate",
    "stage_ops",
    "validate_dataflow",
]

PRE: Final = -1
"""Slot index before megatron's schedule starts (forwards only in a valid table)."""
POST: Final = 2**31 - 1
"""Slot index after the stage's last op, in finalize (backwards only in a valid table)."""

Direction = Literal["forward", "backward"]
Policy = Literal["auto", "stage0", "front_loaded", "uniform"]
POLICIES: Final[tuple[str, ...]] = ("auto", "stage0", "front_loaded", "uniform")
_FIXED: Final = ("uniform", "front_loaded", "stage0")  # the first: auto's default budget
HEADROOM: Final = 1.1
"""``auto`` without an explicit budget holds at most this times ``uniform``'s peak of encoder
activations: it fills idle time first (which costs no step time), then front-loads only within
that headroom, so multiplexing's memory saving over front-loading is kept."""
_EPS = 1e-9


class DataflowError(ValueError):
    """A schedule or dataflow table that megatron or the anchor cannot run (with the reason)."""


# --------------------------------------------------------------------------------------------
# LLM schedule (megatron-core 0.16.1)


@dataclass(frozen=True)
class LLMOp:
    """One LLM pipeline op on a stage: forward or backward of (micro-batch, model chunk)."""

    kind: Literal["F", "B"]
    microbatch: int
    chunk: int = 0

    def label(self, vpp: int = 1) -> str:
        """``F(2)`` when there is one chunk, ``F(2,1)`` (micro-batch, chunk) otherwise."""
        if vpp == 1:
            return f"{self.kind}({self.microbatch})"
        return f"{self.kind}({self.microbatch},{self.chunk})"

    @property
    def signed(self) -> int:
        """The paper's signed micro-batch: +(m+1) for a forward, -(m+1) for a backward."""
        return self.microbatch + 1 if self.kind == "F" else -(self.microbatch + 1)


def check_layout(*, pp: int, vpp: int, num_microbatches: int) -> None:
    """Reject layouts megatron's schedules refuse, with the reason (before any process starts)."""
    if pp < 1 or vpp < 1 or num_microbatches < 1:
        raise DataflowError(
            f"pp, vpp and num_microbatches must be >= 1 (got pp={pp}, vpp={vpp}, "
            f"num_microbatches={num_microbatches})"
        )
    if vpp > 1 and pp == 1:
        raise DataflowError(
            f"vpp={vpp} needs pp > 1: with pp=1 megatron runs forward_backward_no_pipelining, "
            "which does not support model chunks"
        )
    if vpp > 1 and (num_microbatches < pp or num_microbatches % pp):
        raise DataflowError(
            f"interleaved schedule (vpp={vpp}) needs num_microbatches to be a positive multiple "
            f"of pp={pp} (megatron groups pp micro-batches per virtual stage); "
            f"got num_microbatches={num_microbatches}"
        )


def _schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """megatron's ``get_schedule_table``: (micro-batch, chunk) per virtual micro-batch id."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table.extend((m, c) for c in range(vpp) for m in range(first, last))
    return table


def stage_ops(*, stage: int, pp: int, vpp: int, num_microbatches: int) -> list[LLMOp]:
    """The exact op order megatron-core 0.16.1 runs on ``stage`` (training, no MoE overlap).

    pp == 1: ``forward_backward_no_pipelining`` (F then B per micro-batch); vpp == 1: 1F1B
    ``forward_backward_pipelining_without_interleaving``; vpp > 1: the interleaved schedule with the
    default ``microbatch_group_size_per_vp_stage = pp``. Warmup forwards, steady (F then B),
    cooldown backwards, as in ``schedules.py``.
    """
    check_layout(pp=pp, vpp=vpp, num_microbatches=num_microbatches)
    if not 0 <= stage < pp:
        raise DataflowError(f"stage {stage} is outside 0..{pp - 1}")
    m_total = num_microbatches
    if pp == 1:
        return [op for m in range(m_total) for op in (LLMOp("F", m, 0), LLMOp("B", m, 0))]
    if vpp == 1:
        fwd = [LLMOp("F", m, 0) for m in range(m_total)]
        bwd = [LLMOp("B", m, 0) for m in range(m_total)]
        warmup = min(pp - stage - 1, m_total)
    else:
        table = _schedule_table(m_total, vpp, pp)
        fwd = [LLMOp("F", m, c) for m, c in table]
        bwd = [LLMOp("B", m, vpp - 1 - c) for m, c in table]
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, len(table))
    total = len(fwd)
    ops = fwd[:warmup]
    for k in range(total - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    ops += bwd[total - warmup :]
    return ops


# --------------------------------------------------------------------------------------------
# The table


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


# --------------------------------------------------------------------------------------------
# Happens-before graph


class _Graph:
    """Happens-before graph of one step: every stage's ops and slots, plus encoder edges."""

    def __init__(self, pp: int, vpp: int, num_microbatches: int) -> None:
        self.pp, self.vpp, self.m = pp, vpp, num_microbatches
        self.labels: list[str] = []
        self.stage_of: list[int] = []
        self.weight: list[float] = []
        self.succ: list[list[int]] = []
        self.pred: list[list[int]] = []
        self.indeg: list[int] = []  # kept by edge/unedge: start_times runs per candidate
        # A topological order from the last full sort, each node's place in it, and how many
        # edges added since run against it: while none does, start_times is one pass in it.
        self.order: list[int] = []
        self.place: list[int] = []
        self.against = 0
        self.op: dict[tuple[int, str, int, int], int] = {}  # (stage, kind, m, c) -> node
        self.slot: dict[tuple[int, int], int] = {}  # (stage, slot index) -> node
        self.fwd_slot: dict[tuple[int, int, int], int] = {}  # (stage, m, c) -> slot node of F
        self.ops: list[list[LLMOp]] = []
        for s in range(pp):
            ops = stage_ops(stage=s, pp=pp, vpp=vpp, num_microbatches=num_microbatches)
            self.ops.append(ops)
            prev = self._add(s, f"stage {s} PRE", slot=PRE)
            i = 0
            for op in ops:
                if op.kind == "F":
                    node = self._add(s, f"stage {s} slot {i}", slot=i)
                    self.fwd_slot[(s, op.microbatch, op.chunk)] = node
                    self.edge(prev, node)
                    prev, i = node, i + 1
                node = self._add(s, f"stage {s} {op.label(vpp)}", op=op)
                self.edge(prev, node)
                prev = node
            self.edge(prev, self._add(s, f"stage {s} POST", slot=POST))
        last = pp - 1
        for m in range(num_microbatches):
            for c in range(vpp):
                for s in range(1, pp):
                    self.edge(self.op[(s - 1, "F", m, c)], self.fwd_slot[(s, m, c)])
                    self.edge(self.op[(s, "B", m, c)], self.op[(s - 1, "B", m, c)])
                if c > 0:
                    self.edge(self.op[(last, "F", m, c - 1)], self.fwd_slot[(0, m, c)])
                if c < vpp - 1:
                    self.edge(self.op[(0, "B", m, c + 1)], self.op[(last, "B", m, c)])

    @classmethod
    def of(cls, pp: int, vpp: int, num_microbatches: int) -> _Graph:
        """A fresh graph of the layout (no encoder work yet): a copy of one built once, as the
        planners build one per table and policy, every step."""
        base = _base_graph(pp, vpp, num_microbatches)
        g = copy.copy(base)  # names, stages and node maps stay shared: never changed after init
        g.weight, g.indeg = base.weight.copy(), base.indeg.copy()
        g.succ, g.pred = [x.copy() for x in base.succ], [x.copy() for x in base.pred]
        return g

    def _add(self, stage: int, label: str, *, op: LLMOp | None = None, slot: int = 0) -> int:
        node = len(self.labels)
        self.labels.append(label)
        self.stage_of.append(stage)
        self.weight.append(0.0)
        self.succ.append([])
        self.pred.append([])
        self.indeg.append(0)
        if op is not None:
            self.op[(stage, op.kind, op.microbatch, op.chunk)] = node
        else:
            self.slot[(stage, slot)] = node
        return node

    def edge(self, a: int, b: int) -> None:
        self.succ[a].append(b)
        self.pred[b].append(a)
        self.indeg[b] += 1
        self.against += self._against(a, b)

    def unedge(self, a: int, b: int) -> None:
        """Remove one ``a -> b`` edge (a placement tried and taken back)."""
        self.succ[a].remove(b)
        self.pred[b].remove(a)
        self.indeg[b] -= 1
        self.against -= self._against(a, b)

    def _against(self, a: int, b: int) -> bool:
        return bool(self.order) and self.place[a] > self.place[b]

    def makespan(self, start: list[float]) -> float:
        """When the last node ends, given every node's start."""
        return max(map(operator.add, start, self.weight))

    def path(self, src: int, dst: int) -> list[int] | None:
        """A path src -> dst (BFS), or None when dst does not depend on src."""
        parent = {src: src}
        queue = deque([src])
        while queue:
            a = queue.popleft()
            if a == dst:
                out = [a]
                while out[-1] != src:
                    out.append(parent[out[-1]])
                return out[::-1]
            for b in self.succ[a]:
                if b not in parent:
                    parent[b] = a
                    queue.append(b)
        return None

    def reach(self, src: int, *, reverse: bool = False) -> set[int]:
        """Nodes reachable from src (or reaching src when ``reverse``)."""
        adj = self.pred if reverse else self.succ
        seen = {src}
        stack = [src]
        while stack:
            for b in adj[stack.pop()]:
                if b not in seen:
                    seen.add(b)
                    stack.append(b)
        return seen

    def start_times(self, extra: tuple[int, int] | None = None) -> list[float] | None:
        """Earliest start of every node (longest path); None if cyclic. ``extra``: one more
        edge, for trying a placement without keeping it."""
        if extra:
            self.edge(*extra)
            try:
                return self.start_times()
            finally:
                self.unedge(*extra)
        succ, weight = self.succ, self.weight
        start = [0.0] * len(succ)
        if self.order and not self.against:  # nodes are only added before the first sort
            for a in self.order:  # planners try thousands of placements: the fast path
                end = start[a] + weight[a]
                for b in succ[a]:
                    if end > start[b]:
                        start[b] = end
            return start
        indeg = self.indeg.copy()
        ready = [a for a, d in enumerate(indeg) if d == 0]
        order = []
        while ready:
            a = ready.pop()
            order.append(a)
            end = start[a] + weight[a]
            for b in succ[a]:
                if end > start[b]:
                    start[b] = end
                indeg[b] -= 1
                if not indeg[b]:
                    ready.append(b)
        if len(order) < len(succ):
            return None
        self.order, self.place, self.against = order, [0] * len(order), 0
        for k, a in enumerate(order):
            self.place[a] = k
        return start


@functools.lru_cache(maxsize=16)
def _base_graph(pp: int, vpp: int, num_microbatches: int) -> _Graph:
    g = _Graph(pp, vpp, num_microbatches)
    g.start_times()  # its topological order comes with every copy
    return g


def _graph_of(table: DataflowTable, *, f: float = 1.0, b: float = 2.0) -> _Graph:
    """The table's happens-before graph, weighted with the simple time model."""
    g = _Graph.of(table.pp, table.vpp, table.num_microbatches)
    for (_, kind, _, _), node in g.op.items():
        g.weight[node] = f if kind == "F" else b
    for e in table.encoder_mbs:
        fs, bs = table.forward[e.id], table.backward[e.id]
        fnode, bnode = g.slot[(fs.stage, fs.index)], g.slot[(bs.stage, bs.index)]
        g.weight[fnode] += e.cost * f
        g.weight[bnode] += e.cost * b
        g.edge(fnode, g.op[(0, "F", e.microbatch, 0)])
        g.edge(g.op[(0, "B", e.microbatch, 0)], bnode)
    return g


# --------------------------------------------------------------------------------------------
# Validation


def _check_structure(table: DataflowTable) -> None:
    check_layout(pp=table.pp, vpp=table.vpp, num_microbatches=table.num_microbatches)
    seen: set[int] = set()
    for e in table.encoder_mbs:
        if e.id in seen:
            raise DataflowError(f"encoder mb id {e.id} appears twice")
        seen.add(e.id)
        if not 0 <= e.microbatch < table.num_microbatches:
            raise DataflowError(
                f"{e.describe()}: micro-batch outside 0..{table.num_microbatches - 1}"
            )
        if e.cost < 0:
            raise DataflowError(f"{e.describe()}: negative cost {e.cost}")
        if e.memory < 0:
            raise DataflowError(f"{e.describe()}: negative activations {e.activations}")
    for name, slots in (("forward", table.forward), ("backward", table.backward)):
        if set(slots) != seen:
            missing, extra = sorted(seen - set(slots)), sorted(set(slots) - seen)
            raise DataflowError(
                f"every encoder mb needs exactly one {name} slot "
                f"(missing: {missing}, unknown ids: {extra})"
            )
    n = table.num_forward_ops
    for e in table.encoder_mbs:
        fs, bs = table.forward[e.id], table.backward[e.id]
        for name, s in (("forward", fs), ("backward", bs)):
            if not 0 <= s.stage < table.pp or not (s.index in (PRE, POST) or 0 <= s.index < n):
                raise DataflowError(
                    f"{e.describe()}: {name} slot (stage {s.stage}, index {s.index}) does not "
                    f"exist (stages 0..{table.pp - 1}; index PRE, 0..{n - 1} or POST)"
                )
        if fs.stage != bs.stage:
            raise DataflowError(
                f"{e.describe()}: forward on stage {fs.stage} but backward on stage {bs.stage}; "
                "both must run where its activations live"
            )


def _check_order(table: DataflowTable) -> None:
    """Per stage and direction, encoder mbs must run in ascending (micro-batch, id) order: stage 0
    receives outputs (and sends gradients) in that order, and NCCL needs both ends to agree."""
    for direction in ("forward", "backward"):
        slots = table.forward if direction == "forward" else table.backward
        for stage in range(table.pp):
            here = sorted(
                (slots[e.id].index, e.microbatch, e.id)
                for e in table.encoder_mbs
                if slots[e.id].stage == stage
            )
            for (s_a, m_a, a), (s_b, m_b, b) in itertools.pairwise(here):
                if (m_b, b) < (m_a, a):
                    ea, eb = table.mb(a), table.mb(b)
                    raise DataflowError(
                        f"{eb.describe()} runs its {direction} on stage {stage} "
                        f"{table.describe_slot(Slot(stage, s_b))}, after {ea.describe()} "
                        f"{table.describe_slot(Slot(stage, s_a))}: encoder {direction}s on a "
                        "stage must run in ascending micro-batch order (stage 0 "
                        f"{'receives' if direction == 'forward' else 'sends'} them in that "
                        "order; mismatched orders deadlock NCCL)"
                    )


def validate_dataflow(table: DataflowTable) -> None:
    """Raise :class:`DataflowError` naming the encoder mb, its slot and the violation, unless the
    table can run: one slot pair per mb on one stage, ascending order, acyclic dependencies."""
    _check_structure(table)
    _check_order(table)
    g = _graph_of(table)
    for e in sorted(table.encoder_mbs, key=lambda e: (e.microbatch, e.id)):
        fs, bs = table.forward[e.id], table.backward[e.id]
        need = g.op[(0, "F", e.microbatch, 0)]
        path = g.path(need, g.slot[(fs.stage, fs.index)])
        if path is not None:
            where = (
                f"stage {fs.stage}'s {table.describe_slot(fs).removeprefix('before ')}"
                if not (fs.is_pre or fs.is_post)
                else f"stage {fs.stage}'s {'PRE' if fs.is_pre else 'POST'} slot"
            )
            raise DataflowError(
                f"{e.describe()} runs on stage {fs.stage} {table.describe_slot(fs)} but stage 0 "
                f"needs it at {LLMOp('F', e.microbatch).label(table.vpp)}, which {where} "
                f"depends on ({' -> '.join(g.labels[p] for p in path)}): deadlock"
            )
    for e in sorted(table.encoder_mbs, key=lambda e: (e.microbatch, e.id)):
        bs = table.backward[e.id]
        grad = g.op[(0, "B", e.microbatch, 0)]
        path = g.path(g.slot[(bs.stage, bs.index)], grad)
        if path is not None:
            raise DataflowError(
                f"{e.describe()} runs its backward on stage {bs.stage} {table.describe_slot(bs)} "
                f"but its gradient only comes from stage 0's "
                f"{LLMOp('B', e.microbatch).label(table.vpp)}, which waits on that slot "
                f"({' -> '.join(g.labels[p] for p in path)}): deadlock"
            )
    if g.start_times() is None:  # every cycle passes an encoder edge, caught above
        raise DataflowError("dependency cycle in the joint schedule")


# --------------------------------------------------------------------------------------------
# Planners


def _lpt(encoder_mbs: Sequence[EncoderMicroBatch], pp: int) -> dict[int, int]:
    """Longest processing time first: heaviest mb to the least loaded stage (ties: lower id,
    lower stage)."""
    heap = [(0.0, s) for s in range(pp)]
    out: dict[int, int] = {}
    for e in sorted(encoder_mbs, key=lambda e: (-e.cost, e.id)):
        load, s = heapq.heappop(heap)
        out[e.id] = s
        heapq.heappush(heap, (load + e.cost, s))
    return out


def _first_slot_after(ops: list[LLMOp], op: LLMOp) -> int:
    """Index of the first forward slot after ``op`` in program order, else POST."""
    i = 0
    after = False
    for o in ops:
        if o == op:
            after = True
        elif o.kind == "F":
            if after:
                return i
            i += 1
    return POST


def _plan_uniform(
    table: DataflowTable, stage_of: dict[int, int]
) -> tuple[dict[int, Slot], dict[int, Slot]]:
    """On-demand insertion against the time model (see :func:`plan_dataflow`)."""
    pp, n = table.pp, table.num_forward_ops
    g = _Graph.of(pp, table.vpp, table.num_microbatches)
    for (_, kind, _, _), node in g.op.items():
        g.weight[node] = 1.0 if kind == "F" else 2.0
    order = sorted(table.encoder_mbs, key=lambda e: (e.microbatch, e.id))
    fwd: dict[int, Slot] = {}
    last = dict.fromkeys(range(pp), PRE)
    for e in order:
        k = stage_of[e.id]
        need = g.op[(0, "F", e.microbatch, 0)]
        after_need = g.reach(need)
        cands = [i for i in [PRE, *range(n)] if i >= last[k] and g.slot[(k, i)] not in after_need]
        base = g.start_times()
        assert base is not None
        best: tuple[float, int] | None = None  # (delay, index): least delay, latest index
        for i in reversed(cands):
            node = g.slot[(k, i)]
            g.weight[node] += e.cost
            times = g.start_times(extra=(node, need))
            g.weight[node] -= e.cost
            assert times is not None
            delay = max(0.0, times[need] - base[need])
            if delay <= _EPS:
                best = (0.0, i)
                break
            if best is None or delay < best[0] - _EPS:
                best = (delay, i)
        assert best is not None
        fwd[e.id] = Slot(k, best[1])
        last[k] = best[1]
        node = g.slot[(k, best[1])]
        g.weight[node] += e.cost
        g.edge(node, need)
    bwd: dict[int, Slot] = {}
    last = dict.fromkeys(range(pp), PRE)
    for e in order:
        k = stage_of[e.id]
        grad = g.op[(0, "B", e.microbatch, 0)]
        times = g.start_times()
        assert times is not None
        ready = times[grad] + g.weight[grad]
        before_grad = g.reach(grad, reverse=True)
        idx = POST
        for i in range(max(last[k], 0), n):
            node = g.slot[(k, i)]
            if node not in before_grad and times[node] >= ready - _EPS:
                idx = i
                break
        bwd[e.id] = Slot(k, idx)
        last[k] = idx
        node = g.slot[(k, idx)]
        g.weight[node] += 2.0 * e.cost
        g.edge(grad, node)
    return fwd, bwd


def _peak_live(live: Sequence[tuple[int, int, float]], lo: int, hi: int) -> float:
    """Peak of the activations held at slots ``lo <= s < hi`` of one stage, each entry
    ``(forward index, backward index, memory)`` held from its forward slot until its backward slot
    (a slot runs its backwards first, so memory freed there is reused by its forwards)."""
    points = [lo, *(f for f, _, _ in live if lo < f < hi)]
    return max((sum(m for f, b, m in live if f <= s < b) for s in points), default=0.0)


def _stage_budgets(budget: float | Sequence[float], pp: int) -> list[float]:
    if isinstance(budget, int | float):
        return [float(budget)] * pp
    if len(budget) != pp:
        raise DataflowError(f"budget names {len(budget)} stages, the pipeline has {pp}")
    return [float(b) for b in budget]


def _auto_budgets(
    uniform: float,
    budget: float | Sequence[float] | None,
    device_budget: float | Sequence[float] | None,
    pp: int,
) -> list[float]:
    """Per stage, what ``auto`` may hold: the explicit ``budget``, else :data:`HEADROOM` x
    ``uniform`` (the largest stage peak of the ``uniform`` table), within ``device_budget``."""
    if budget is not None:
        return _stage_budgets(budget, pp)
    room = [math.inf] * pp if device_budget is None else _stage_budgets(device_budget, pp)
    return [min(HEADROOM * uniform, r) for r in room]


def _plan_auto(
    proto: DataflowTable,
    budget: float | Sequence[float] | None,
    device_budget: float | Sequence[float] | None,
    shared_cores: bool,
) -> tuple[dict[int, Slot], dict[int, Slot]]:
    """The greedy plan, or the fixed policy's table where that one is better in the time model
    (:func:`_rank`: least excess of a stage over its budget, then makespan, then peak), refined
    by :class:`_Refiner`: never worse than any of them. With ``shared_cores``, ``front_loaded``'s
    table wherever it fits the budgets: idle time is not free there (see :func:`plan_dataflow`)."""
    kw = {"pp": proto.pp, "vpp": proto.vpp, "num_microbatches": proto.num_microbatches}
    fixed = [plan_dataflow(p, **kw, encoder_mbs=proto.encoder_mbs) for p in _FIXED]
    budgets = _auto_budgets(max(_stage_peaks(fixed[0])), budget, device_budget, proto.pp)
    front = fixed[_FIXED.index("front_loaded")]
    fits = round(max(p - b for p, b in zip(_stage_peaks(front), budgets, strict=True)), 9) <= 0
    if shared_cores and fits:
        return dict(front.forward), dict(front.backward)
    fwd, bwd = _AutoPlanner(proto, budgets).plan()
    greedy = DataflowTable(**kw, encoder_mbs=proto.encoder_mbs, forward=fwd, backward=bwd)

    def rank(table: DataflowTable) -> tuple[float, float, float]:
        g = _graph_of(table)  # no validation: plan_dataflow validates what it returns
        start = g.start_times()
        assert start is not None
        makespan = g.makespan(start)
        return _rank(_stage_peaks(table), budgets, makespan)

    best = min([greedy, *fixed], key=rank)  # min keeps the first of ties: the greedy plan
    return _Refiner(best, budgets).refine()


def _rank(
    peaks: Sequence[float], budgets: Sequence[float], makespan: float
) -> tuple[float, float, float]:
    """What ``auto`` minimises, in order: the worst stage's excess over its budget, the
    makespan, the largest peak (rounded so float noise never decides)."""
    excess = max(p - b for p, b in zip(peaks, budgets, strict=True))
    return round(max(excess, 0.0), 9), round(makespan, 9), max(peaks)


def _put(g: _Graph, e: EncoderMicroBatch, k: int, i: int, j: int, sign: int) -> None:
    """Add (``sign`` 1) or remove (-1) ``e`` at forward slot ``i`` and backward slot ``j`` of
    stage ``k``: their weights, and the edges to stage 0's F(m,0) and from its B(m,0)."""
    need, grad = g.op[(0, "F", e.microbatch, 0)], g.op[(0, "B", e.microbatch, 0)]
    f, b = g.slot[(k, i)], g.slot[(k, j)]
    g.weight[f] += sign * e.cost
    g.weight[b] += sign * 2.0 * e.cost
    if sign > 0:
        g.edge(f, need)
        g.edge(grad, b)
    else:
        g.unedge(f, need)
        g.unedge(grad, b)


_REFINE_WORK: Final = 2_000_000
"""Graph nodes :class:`_Refiner` may visit in all (each evaluation visits the whole graph): a
count, never a clock, so every rank plans the same table; about 650 evaluations at pp 8 x 64
micro-batches, a full search on small pipelines."""


class _Refiner:
    """Local search after ``auto``'s greedy: each encoder mb in turn moves to the stage and slot
    pair (within the order its stage's other mbs keep) that most improves :func:`_rank`, in
    passes until none improves or :data:`_REFINE_WORK` is spent. The greedy chooses an early
    mb's place before the later ones exist and never revisits it; here every mb is placed again
    knowing all the others, so the result is never worse than the table it starts from."""

    def __init__(self, table: DataflowTable, budgets: list[float]) -> None:
        self.table, self.budgets, self.n = table, budgets, table.num_forward_ops
        self.shape = {
            "pp": table.pp, "vpp": table.vpp, "num_microbatches": table.num_microbatches,
            "encoder_mbs": table.encoder_mbs,
        }  # fmt: skip
        self.g = _graph_of(table)
        self.fwd, self.bwd = dict(table.forward), dict(table.backward)
        self.order = sorted(table.encoder_mbs, key=lambda e: (e.microbatch, e.id))
        self.left = _REFINE_WORK // len(self.g.succ)
        self.key = self._key(self.g.start_times(), self._peaks())

    def refine(self) -> tuple[dict[int, Slot], dict[int, Slot]]:
        """Round robin over the mbs until each was tried since the last move (then none can
        move: nothing changed since it found its best place)."""
        since = 0  # mbs tried since the last move
        for e in itertools.cycle(self.order):
            if since == len(self.order) or self.left <= 0:
                break
            since = 0 if self._move(e) else since + 1
        return self.fwd, self.bwd

    def _peaks(self, skip: int | None = None) -> list[float]:
        now = DataflowTable(**self.shape, forward=self.fwd, backward=self.bwd)
        return _stage_peaks(now, skip=skip)

    def _key(self, times: list[float] | None, peaks: list[float]) -> tuple[float, float, float]:
        # every candidate keeps the forward before F(m,0) and the backward after B(m,0)
        assert times is not None
        makespan = self.g.makespan(times)
        return _rank(peaks, self.budgets, makespan)

    def _move(self, e: EncoderMicroBatch) -> bool:
        """Place ``e`` at its best pair; True when that is better than where it was."""
        g, old = self.g, (self.fwd[e.id].stage, self.fwd[e.id].index, self.bwd[e.id].index)
        _put(g, e, *old, -1)
        need, grad = g.op[(0, "F", e.microbatch, 0)], g.op[(0, "B", e.microbatch, 0)]
        after_need, before_grad = g.reach(need), g.reach(grad, reverse=True)
        times = g.start_times()
        assert times is not None
        ready = times[grad] + g.weight[grad]
        base = self._peaks(skip=e.id)
        # no place beats the step and the peaks without e: at that bound, nothing to search
        bound = self._key(times, base)
        best, choice = self.key, old
        live = [  # per stage, the other mbs' (forward, backward, memory): they stay put here
            [
                (self.fwd[x.id].index, self.bwd[x.id].index, x.memory)
                for x in self.order
                if x.id != e.id and self.fwd[x.id].stage == k
            ]
            for k in range(self.table.pp)
        ]
        for k, i, j in self._pairs(e, old, times, ready, after_need, before_grad):
            if self.left <= 0 or best <= bound:
                break
            _put(g, e, k, i, j, 1)
            mine = _peak_live([*live[k], (i, j, e.memory)], PRE, POST)
            peaks = [*base[:k], mine, *base[k + 1 :]]
            key = self._key(g.start_times(), peaks)
            _put(g, e, k, i, j, -1)
            self.left -= 1
            if key < best:
                best, choice = key, (k, i, j)
        _put(g, e, *choice, 1)
        self.fwd[e.id], self.bwd[e.id] = Slot(choice[0], choice[1]), Slot(choice[0], choice[2])
        moved, self.key = best < self.key, best
        return moved

    def _pairs(
        self,
        e: EncoderMicroBatch,
        old: tuple[int, int, int],
        times: list[float],
        ready: float,
        after_need: set[int],
        before_grad: set[int],
    ) -> Iterator[tuple[int, int, int]]:
        """The (stage, forward, backward) triples worth trying: forwards at PRE, next to the
        current one, before idle time, or the latest two; backwards the first valid, the first
        that need not wait for the gradient, those before idle time, the last two (POST among
        them). Each within the ascending order of the stage's other mbs (:func:`_check_order`)
        and free of cycles."""
        g, key = self.g, (e.microbatch, e.id)
        for k in range(self.table.pp):
            others = [x for x in self.order if x.id != e.id and self.fwd[x.id].stage == k]
            lo_f = max(
                (self.fwd[x.id].index for x in others if (x.microbatch, x.id) < key), default=PRE
            )
            hi_f = min(
                (self.fwd[x.id].index for x in others if (x.microbatch, x.id) > key), default=POST
            )
            lo_b = max(
                (self.bwd[x.id].index for x in others if (x.microbatch, x.id) < key), default=PRE
            )
            hi_b = min(
                (self.bwd[x.id].index for x in others if (x.microbatch, x.id) > key), default=POST
            )
            forwards = [
                i for i in range(max(lo_f, PRE), min(hi_f, self.n - 1) + 1)
                if g.slot[(k, i)] not in after_need
            ]  # fmt: skip
            near = {old[1] - 1, old[1], old[1] + 1} if k == old[0] else set()
            idle = self._idle_before(k, times)
            for i in (i for i in forwards if i in {PRE, *near, *forwards[-2:], *idle}):
                backwards = [
                    j for j in [*range(max(lo_b, i + 1), min(hi_b, self.n - 1) + 1), POST]
                    if j <= hi_b and g.slot[(k, j)] not in before_grad
                ]  # fmt: skip
                on_time = [j for j in backwards if times[g.slot[(k, j)]] >= ready - _EPS]
                picks = {*backwards[:1], *on_time[:1], *backwards[-2:], *idle}
                if k == old[0]:
                    picks.add(old[2])
                yield from ((k, i, j) for j in backwards if j in picks)

    def _idle_before(self, k: int, times: list[float]) -> set[int]:
        """Stage ``k``'s slots followed by idle time before its next node."""
        g, out, slot = self.g, set(), PRE
        nodes = [v for v, s in enumerate(g.stage_of) if s == k]
        index = {v: i for (s, i), v in g.slot.items() if s == k}
        for a, b in itertools.pairwise(nodes):
            if a in index:
                slot = index[a]
            if times[b] > times[a] + g.weight[a] + _EPS:
                out.add(slot)
        return out


class _AutoPlanner:
    """Greedy joint placement for ``auto`` (see :func:`plan_dataflow`): each encoder mb in
    ascending (micro-batch, id) order, over every stage and slot, keeping the one with the
    least (budget excess, makespan, activation lifetime, stage load)."""

    def __init__(self, table: DataflowTable, budgets: list[float]) -> None:
        self.table, self.budgets, self.n = table, budgets, table.num_forward_ops
        self.g = _Graph.of(table.pp, table.vpp, table.num_microbatches)
        for (_, kind, _, _), node in self.g.op.items():
            self.g.weight[node] = 1.0 if kind == "F" else 2.0
        self.last_f = dict.fromkeys(range(table.pp), PRE)
        self.last_b = dict.fromkeys(range(table.pp), PRE)
        self.live: dict[int, list[tuple[int, int, float]]] = {k: [] for k in range(table.pp)}
        self.load = dict.fromkeys(range(table.pp), 0.0)
        self.fwd: dict[int, Slot] = {}
        self.bwd: dict[int, Slot] = {}
        self.order = [[v for v, s in enumerate(self.g.stage_of) if s == k] for k in range(table.pp)]
        self.slot_index = {v: i for (_, i), v in self.g.slot.items()}

    def plan(self) -> tuple[dict[int, Slot], dict[int, Slot]]:
        for e in sorted(self.table.encoder_mbs, key=lambda e: (e.microbatch, e.id)):
            self._place(e)
        return self.fwd, self.bwd

    def _place(self, e: EncoderMicroBatch) -> None:
        g = self.g
        need, grad = g.op[(0, "F", e.microbatch, 0)], g.op[(0, "B", e.microbatch, 0)]
        after_need, before_grad = g.reach(need), g.reach(grad, reverse=True)
        times = g.start_times()
        assert times is not None
        best: tuple[tuple[float, ...], int, int, int] | None = None
        for k in range(self.table.pp):
            for i in self._candidates(k, after_need, times):
                key, j = self._try(e, k, i, grad, before_grad, times)
                if best is None or key < best[0]:
                    best = (key, k, i, j)
        assert best is not None  # PRE of every stage precedes stage 0's F(m, 0)
        _, k, i, j = best
        _put(g, e, k, i, j, 1)
        self.fwd[e.id], self.bwd[e.id] = Slot(k, i), Slot(k, j)
        self.last_f[k], self.last_b[k] = i, j
        self.live[k].append((i, j, e.memory))
        self.load[k] += e.cost

    def _candidates(self, k: int, after_need: set[int], times: list[float]) -> list[int]:
        """The forward slots worth trying on stage ``k``: PRE (front-loading), those followed by
        idle time before the stage's next slot (work there may hide in it), and the latest two
        (on demand). The others only delay more LLM ops than the latest ones; skipping them
        keeps planning linear in the slots."""
        g = self.g
        valid = [
            i for i in [PRE, *range(self.n)]
            if i >= self.last_f[k] and g.slot[(k, i)] not in after_need
        ]  # fmt: skip
        order = self.order[k]
        idle: set[int] = set()
        slot = PRE
        for a, b in itertools.pairwise(order):
            if b in self.slot_index:
                slot = self.slot_index[b]
            elif times[b] > times[a] + g.weight[a] + _EPS:
                idle.add(slot)
        keep = {PRE, *valid[-2:], *idle}
        return [i for i in valid if i in keep]

    def _backward_slots(
        self, k: int, i: int, grad: int, before_grad: set[int], times: list[float]
    ) -> list[int]:
        """The first slot after the forward whose start does not wait for stage 0's B(m, 0) (else
        POST), preceded by the first valid one where that is earlier (it frees memory sooner);
        by the start times before this mb (the score then times each exactly)."""
        g = self.g
        ready = times[grad] + g.weight[grad]
        valid = [
            j for j in range(max(i + 1, self.last_b[k], 0), self.n)
            if g.slot[(k, j)] not in before_grad
        ]  # fmt: skip
        on_time = [j for j in valid if times[g.slot[(k, j)]] >= ready - _EPS]
        first = on_time[0] if on_time else POST
        return [valid[0], first] if valid and valid[0] < first else [first]

    def _try(
        self,
        e: EncoderMicroBatch,
        k: int,
        i: int,
        grad: int,
        before_grad: set[int],
        times: list[float],
    ) -> tuple[tuple[float, ...], int]:
        js = self._backward_slots(k, i, grad, before_grad, times)
        return min(self._score(e, k, i, j) for j in js)

    def _score(self, e: EncoderMicroBatch, k: int, i: int, j: int) -> tuple[tuple[float, ...], int]:
        g = self.g
        _put(g, e, k, i, j, 1)
        times = g.start_times()
        _put(g, e, k, i, j, -1)
        assert times is not None  # i precedes need, j follows grad: no cycle
        makespan = g.makespan(times)
        excess = max(0.0, _peak_live([*self.live[k], (i, j, e.memory)], i, j) - self.budgets[k])
        delays = sum(map(times.__getitem__, g.op.values()))
        node, bslot = g.slot[(k, i)], g.slot[(k, j)]
        lifetime = e.memory * (times[bslot] + g.weight[bslot] - times[node])
        key = (
            round(excess, 9), round(makespan, 9), round(delays, 9), round(lifetime, 9),
            self.load[k], k, -i,
        )  # fmt: skip
        return key, j


def plan_dataflow(
    policy: Policy,
    *,
    pp: int,
    vpp: int,
    num_microbatches: int,
    encoder_mbs: Iterable[EncoderMicroBatch],
    budget: float | Sequence[float] | None = None,
    device_budget: float | Sequence[float] | None = None,
    shared_cores: bool = False,
) -> DataflowTable:
    """Build a valid table with one of the policies (the result always passes validation).

    - ``auto`` (the default): places each encoder mb, in ascending (micro-batch, id) order, at
      the stage and slot (forward, then its backward at the first slot after stage 0's B(m,0)
      has finished, else POST) that keeps the stage's live encoder activations within
      ``budget`` and then gives the least makespan in the time model below; ties go to the
      shortest activation lifetime (the latest slot), then the least loaded stage. Encoder work
      thus fills idle time first (warm-up and cool-down bubbles, waits on peers: the makespan
      does not grow), is front-loaded where that shortens the step and the budget allows, and
      is otherwise inserted on demand. A mb that fits nowhere takes the slot exceeding the
      budget least. The best of this and the fixed tables is then refined by a local search
      (each mb placed again knowing all the others, until none moves). ``budget``: per stage (or one
      for all), in :attr:`EncoderMicroBatch.memory` units (bytes in the trainer and simulator: the
      manifest's ``memoryBudget``); where ``front_loaded`` fits it, ``auto`` is at least as fast;
      None: :data:`HEADROOM` x the largest stage peak of the ``uniform`` table, and at most
      ``device_budget`` (what the device leaves beside the LLM, see
      :mod:`~omni_trainer.multiplex.encoder_policy`), so ``auto`` holds barely more encoder
      activations than on-demand insertion. ``shared_cores``: the stages share fewer CPU cores than
      they have threads (a local run), so one stage's idle time is another's compute and filling it
      gains nothing the time model (a device per stage) would credit; ``auto`` then takes
      ``front_loaded``'s table wherever that fits the budget (no encoder work inside the LLM
      schedule, nothing to search), and plans as above elsewhere.
      Only ``auto`` reads these three.

    - ``stage0``: the unimodal-like baseline; every encoder mb on stage 0 just before F(m,0),
      backward at the first stage-0 slot after B(m,0) (or POST).
    - ``front_loaded``: stages balanced by cost (LPT), every forward at PRE, every backward at
      POST (the paper's counter-example).
    - ``uniform`` (the paper's): stages balanced by cost (LPT, ties by id); in ascending
      (micro-batch, id) order each forward goes to the LATEST valid slot on its stage that does not
      delay stage 0's F(m,0) in the time model (F = 1, B = 2, encoder forward = cost, backward =
      2 x cost; start times by longest path in the happens-before graph). If every slot delays it,
      the least-delaying one, latest among ties: PRE for early micro-batches on stages > 0, just
      before F(m,0) on stage 0 (PRE would front-load stage 0). Backward: the first valid slot
      that starts after stage 0's B(m,0) has finished (so it never waits for its gradient), else
      POST.
    """
    mbs = tuple(encoder_mbs)
    proto = DataflowTable(
        pp,
        vpp,
        num_microbatches,
        mbs,
        forward={e.id: Slot(0, PRE) for e in mbs},
        backward={e.id: Slot(0, POST) for e in mbs},
    )
    _check_structure(proto)  # layout, unique ids, micro-batch range, costs
    if policy == "stage0":
        ops0 = stage_ops(stage=0, pp=pp, vpp=vpp, num_microbatches=num_microbatches)
        forwards = [op for op in ops0 if op.kind == "F"]
        fidx = {op.microbatch: i for i, op in enumerate(forwards) if op.chunk == 0}
        fwd = {e.id: Slot(0, fidx[e.microbatch]) for e in mbs}
        bwd = {e.id: Slot(0, _first_slot_after(ops0, LLMOp("B", e.microbatch, 0))) for e in mbs}
    elif policy == "front_loaded":
        stage_of = _lpt(mbs, pp)
        fwd = {e.id: Slot(stage_of[e.id], PRE) for e in mbs}
        bwd = {e.id: Slot(stage_of[e.id], POST) for e in mbs}
    elif policy == "uniform":
        fwd, bwd = _plan_uniform(proto, _lpt(mbs, pp))
    elif policy == "auto":
        fwd, bwd = _plan_auto(proto, budget, device_budget, shared_cores)
    else:
        raise DataflowError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    table = DataflowTable(pp, vpp, num_microbatches, mbs, fwd, bwd, policy=policy)
    validate_dataflow(table)
    return table


# --------------------------------------------------------------------------------------------
# Simulation and display


def simulate(table: DataflowTable, *, f: float = 1.0, b: float = 2.0) -> dict[str, Any]:
    """Per-stage busy/idle time and makespan of the joint schedule in the simple time model
    (LLM forward op f, backward op b, encoder forward cost*f, backward cost*b, free p2p), plus
    each stage's peak of live encoder activations (sum of :attr:`EncoderMicroBatch.memory` of mbs
    forwarded, not yet backwarded): the memory that on-demand insertion saves and the time model
    does not see."""
    validate_dataflow(table)
    g = _graph_of(table, f=f, b=b)
    start = g.start_times()
    assert start is not None
    makespan = g.makespan(start)
    stages, peaks = [], _stage_peaks(table)
    for k in range(table.pp):
        nodes = [v for v in range(len(start)) if g.stage_of[v] == k]
        busy = sum(g.weight[v] for v in nodes)
        enc = sum(g.weight[v] for v in g.slot.values() if g.stage_of[v] == k)
        stages.append(
            {
                "stage": k,
                "busy": busy,
                "encoder": enc,
                "llm": busy - enc,
                "idle": makespan - busy,
                "peak_encoder_activations": peaks[k],
            }
        )
    idle = sum(s["idle"] for s in stages)
    return {
        "makespan": makespan,
        "stages": stages,
        "bubble_fraction": idle / (makespan * table.pp) if makespan else 0.0,
    }


def _stage_peaks(table: DataflowTable, *, skip: int | None = None) -> list[float]:
    """Per stage, the peak of its live encoder activations (see :func:`_peak_live`), without
    mb ``skip``."""
    live: list[list[tuple[int, int, float]]] = [[] for _ in range(table.pp)]
    for e in table.encoder_mbs:
        if e.id != skip:
            fs, bs = table.forward[e.id], table.backward[e.id]
            live[fs.stage].append((fs.index, bs.index, e.memory))
    return [_peak_live(x, PRE, POST) for x in live]


def format_dataflow(table: DataflowTable) -> str:
    """Readable per-stage listing (E3 = encoder forward, E3' = backward) and the paper notation."""
    lines = [
        f"dataflow table ({table.policy}): pp={table.pp} vpp={table.vpp} "
        f"micro-batches={table.num_microbatches} encoder mbs={len(table.encoder_mbs)}"
    ]

    def enc(stage: int, index: int) -> list[str]:
        return [f"E{i}'" for i in table.at(stage, index, "backward")] + [
            f"E{i}" for i in table.at(stage, index, "forward")
        ]

    for k in range(table.pp):
        tokens = ["|", *enc(k, PRE), "|"]
        i = 0
        for op in table.ops(k):
            if op.kind == "F":
                tokens += enc(k, i)
                i += 1
            tokens.append(op.label(table.vpp))
        tokens += ["|", *enc(k, POST), "|"]
        lines.append(f"stage {k} (encoder cost {table.stage_cost(k):g}): {' '.join(tokens)}")
    lines.append("paper notation {encoder_mb: (pp_rank, [left, right])}, -(id+1) = backward:")
    for key, (stage, pair) in table.paper_notation().items():
        lines.append(f"  {key}: ({stage}, {pair})")
    return "\n".join(lines)
