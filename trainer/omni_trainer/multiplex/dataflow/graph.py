"""The happens-before graph of one step: every stage's LLM ops and slots in program order, the
cross-stage receives, and an edge per encoder micro-batch to stage 0's ``F(m, 0)`` and from its
``B(m, 0)``. Its longest path gives start times in the unit time model (an LLM forward 1, a
backward 2, an encoder forward its cost, its backward twice that, free p2p); a cycle is a
deadlock. The planners try thousands of placements on one graph, so it adds and removes edges
in place and reuses its last topological order while no edge runs against it."""

from __future__ import annotations

import copy
import functools
import operator
from collections import deque
from typing import Final

from omni_trainer.multiplex.dataflow.schedule import LLMOp, stage_ops
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, EncoderMicroBatch

__all__ = ["EPS", "Graph", "graph_of"]

EPS: Final = 1e-9
"""Tolerance of start-time comparisons (a delay below it is none)."""


class Graph:
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
    def of(cls, pp: int, vpp: int, num_microbatches: int) -> Graph:
        """A fresh graph of the layout (no encoder work yet): a copy of one built once, as the
        planners build one per table and policy, every step."""
        base = _base_graph(pp, vpp, num_microbatches)
        g = copy.copy(base)  # names, stages and node maps stay shared: never changed after init
        g.weight, g.indeg = base.weight.copy(), base.indeg.copy()
        g.succ, g.pred = [x.copy() for x in base.succ], [x.copy() for x in base.pred]
        return g

    @classmethod
    def weighted(
        cls, pp: int, vpp: int, num_microbatches: int, *, f: float = 1.0, b: float = 2.0
    ) -> Graph:
        """A fresh graph of the layout with its LLM ops timed: forwards ``f``, backwards ``b``."""
        g = cls.of(pp, vpp, num_microbatches)
        for (_, kind, _, _), node in g.op.items():
            g.weight[node] = f if kind == "F" else b
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

    def put(self, e: EncoderMicroBatch, k: int, i: int, j: int, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``e`` at forward slot ``i`` and backward slot ``j`` of
        stage ``k``: their weights, and the edges to stage 0's F(m,0) and from its B(m,0)."""
        need, grad = self.op[(0, "F", e.microbatch, 0)], self.op[(0, "B", e.microbatch, 0)]
        f, b = self.slot[(k, i)], self.slot[(k, j)]
        self.weight[f] += sign * e.cost
        self.weight[b] += sign * 2.0 * e.cost
        if sign > 0:
            self.edge(f, need)
            self.edge(grad, b)
        else:
            self.unedge(f, need)
            self.unedge(grad, b)

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
def _base_graph(pp: int, vpp: int, num_microbatches: int) -> Graph:
    g = Graph(pp, vpp, num_microbatches)
    g.start_times()  # its topological order comes with every copy
    return g


def graph_of(table: DataflowTable, *, f: float = 1.0, b: float = 2.0) -> Graph:
    """The table's happens-before graph, weighted with the simple time model."""
    g = Graph.weighted(table.pp, table.vpp, table.num_microbatches, f=f, b=b)
    for e in table.encoder_mbs:
        fs, bs = table.forward[e.id], table.backward[e.id]
        fnode, bnode = g.slot[(fs.stage, fs.index)], g.slot[(bs.stage, bs.index)]
        g.weight[fnode] += e.cost * f
        g.weight[bnode] += e.cost * b
        g.edge(fnode, g.op[(0, "F", e.microbatch, 0)])
        g.edge(g.op[(0, "B", e.microbatch, 0)], bnode)
    return g
