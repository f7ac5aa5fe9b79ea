"""``auto``'s objective and its local search: after the greedy placement (and the fixed
policies' tables) the best table found is improved one encoder micro-batch at a time, on a work
budget counted in graph nodes so that every rank plans the same table."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Final

from omni_trainer.multiplex.dataflow.graph import EPS, graph_of
from omni_trainer.multiplex.dataflow.table import (
    POST,
    PRE,
    DataflowTable,
    EncoderMicroBatch,
    Slot,
    peak_live,
    stage_peaks,
)

__all__ = ["REFINE_WORK", "Refiner", "objective"]


def objective(
    peaks: Sequence[float], budgets: Sequence[float], makespan: float
) -> tuple[float, float, float]:
    """What ``auto`` minimises, in order: the worst stage's excess over its budget, the
    makespan, the largest peak (rounded so float noise never decides)."""
    excess = max(p - b for p, b in zip(peaks, budgets, strict=True))
    return round(max(excess, 0.0), 9), round(makespan, 9), max(peaks)


REFINE_WORK: Final = 2_000_000
"""Graph nodes :class:`Refiner` may visit in all (each evaluation visits the whole graph): a
count, never a clock, so every rank plans the same table; about 650 evaluations at pp 8 x 64
micro-batches, a full search on small pipelines."""


class Refiner:
    """Local search after ``auto``'s greedy: each encoder mb in turn moves to the stage and slot
    pair (within the order its stage's other mbs keep) that most improves :func:`objective`, in
    passes until none improves or :data:`REFINE_WORK` is spent. The greedy chooses an early
    mb's place before the later ones exist and never revisits it; here every mb is placed again
    knowing all the others, so the result is never worse than the table it starts from."""

    def __init__(self, table: DataflowTable, budgets: list[float]) -> None:
        self.table, self.budgets, self.n = table, budgets, table.num_forward_ops
        self.shape = {
            "pp": table.pp, "vpp": table.vpp, "num_microbatches": table.num_microbatches,
            "encoder_mbs": table.encoder_mbs,
        }  # fmt: skip
        self.g = graph_of(table)
        self.fwd, self.bwd = dict(table.forward), dict(table.backward)
        self.order = sorted(table.encoder_mbs, key=lambda e: (e.microbatch, e.id))
        self.left = REFINE_WORK // len(self.g.succ)
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
        return stage_peaks(now, skip=skip)

    def _key(self, times: list[float] | None, peaks: list[float]) -> tuple[float, float, float]:
        # every candidate keeps the forward before F(m,0) and the backward after B(m,0)
        assert times is not None
        makespan = self.g.makespan(times)
        return objective(peaks, self.budgets, makespan)

    def _move(self, e: EncoderMicroBatch) -> bool:
        """Place ``e`` at its best pair; True when that is better than where it was."""
        g, old = self.g, (self.fwd[e.id].stage, self.fwd[e.id].index, self.bwd[e.id].index)
        g.put(e, *old, -1)
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
            g.put(e, k, i, j, 1)
            mine = peak_live([*live[k], (i, j, e.memory)], PRE, POST)
            peaks = [*base[:k], mine, *base[k + 1 :]]
            key = self._key(g.start_times(), peaks)
            g.put(e, k, i, j, -1)
            self.left -= 1
            if key < best:
                best, choice = key, (k, i, j)
        g.put(e, *choice, 1)
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
        them). Each within the ascending order of the stage's other mbs (as validation requires)
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
                on_time = [j for j in backwards if times[g.slot[(k, j)]] >= ready - EPS]
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
            if times[b] > times[a] + g.weight[a] + EPS:
                out.add(slot)
        return out
