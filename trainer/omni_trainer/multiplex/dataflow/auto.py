"""The ``auto`` policy: per-stage budgets for encoder activations, a greedy joint placement
that fills idle time first, and the best of it and the fixed policies' tables refined by
:class:`~omni_trainer.multiplex.dataflow.refine.Refiner`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Final

from omni_trainer.multiplex.dataflow.graph import EPS, Graph, graph_of
from omni_trainer.multiplex.dataflow.policies import FIXED_POLICIES, fixed_table
from omni_trainer.multiplex.dataflow.refine import Refiner, objective
from omni_trainer.multiplex.dataflow.schedule import DataflowError
from omni_trainer.multiplex.dataflow.table import (
    POST,
    PRE,
    DataflowTable,
    EncoderMicroBatch,
    Slot,
    peak_live,
    stage_peaks,
)

__all__ = ["HEADROOM", "plan_auto"]

HEADROOM: Final = 1.1
"""``auto`` without an explicit budget holds at most this times ``uniform``'s peak of encoder
activations: it fills idle time first (which costs no step time), then front-loads only within
that headroom, so multiplexing's memory saving over front-loading is kept."""


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


def plan_auto(
    proto: DataflowTable,
    budget: float | Sequence[float] | None,
    device_budget: float | Sequence[float] | None,
    shared_cores: bool,
) -> tuple[dict[int, Slot], dict[int, Slot]]:
    """The greedy plan, or the fixed policy's table where that one is better in the time model
    (:func:`objective`: least excess of a stage over its budget, then makespan, then peak), refined
    by :class:`Refiner`: never worse than any of them. With ``shared_cores``, ``front_loaded``'s
    table wherever it fits the budgets: idle time is not free there (see
    :func:`~omni_trainer.multiplex.dataflow.plan.plan_dataflow`). ``proto``: the layout and the
    encoder mbs, their structure checked (its slots are ignored)."""
    kw = {"pp": proto.pp, "vpp": proto.vpp, "num_microbatches": proto.num_microbatches}
    fixed = [fixed_table(p, proto) for p in FIXED_POLICIES]
    budgets = _auto_budgets(max(stage_peaks(fixed[0])), budget, device_budget, proto.pp)
    front = fixed[FIXED_POLICIES.index("front_loaded")]
    fits = round(max(p - b for p, b in zip(stage_peaks(front), budgets, strict=True)), 9) <= 0
    if shared_cores and fits:
        return dict(front.forward), dict(front.backward)
    fwd, bwd = _AutoPlanner(proto, budgets).plan()
    greedy = DataflowTable(**kw, encoder_mbs=proto.encoder_mbs, forward=fwd, backward=bwd)

    def rank(table: DataflowTable) -> tuple[float, float, float]:
        g = graph_of(table)  # no validation: plan_dataflow validates what it returns
        start = g.start_times()
        assert start is not None
        makespan = g.makespan(start)
        return objective(stage_peaks(table), budgets, makespan)

    best = min([greedy, *fixed], key=rank)  # min keeps the first of ties: the greedy plan
    return Refiner(best, budgets).refine()


class _AutoPlanner:
    """Greedy joint placement for ``auto`` (see
    :func:`~omni_trainer.multiplex.dataflow.plan.plan_dataflow`): each encoder mb in
    ascending (micro-batch, id) order, over every stage and slot, keeping the one with the
    least (budget excess, makespan, activation lifetime, stage load)."""

    def __init__(self, table: DataflowTable, budgets: list[float]) -> None:
        self.table, self.budgets, self.n = table, budgets, table.num_forward_ops
        self.g = Graph.weighted(table.pp, table.vpp, table.num_microbatches)
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
        g.put(e, k, i, j, 1)
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
            elif times[b] > times[a] + g.weight[a] + EPS:
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
        on_time = [j for j in valid if times[g.slot[(k, j)]] >= ready - EPS]
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
        g.put(e, k, i, j, 1)
        times = g.start_times()
        g.put(e, k, i, j, -1)
        assert times is not None  # i precedes need, j follows grad: no cycle
        makespan = g.makespan(times)
        excess = max(0.0, peak_live([*self.live[k], (i, j, e.memory)], i, j) - self.budgets[k])
        delays = sum(map(times.__getitem__, g.op.values()))
        node, bslot = g.slot[(k, i)], g.slot[(k, j)]
        lifetime = e.memory * (times[bslot] + g.weight[bslot] - times[node])
        key = (
            round(excess, 9), round(makespan, 9), round(delays, 9), round(lifetime, 9),
            self.load[k], k, -i,
        )  # fmt: skip
        return key, j
