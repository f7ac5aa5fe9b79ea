"""The fixed policies: ``stage0`` (the unimodal-like baseline), ``front_loaded`` (the paper's
counter-example) and ``uniform`` (the paper's on-demand insertion against the time model). What
each places where is described with :func:`~omni_trainer.multiplex.dataflow.plan.plan_dataflow`."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Final

from omni_trainer.multiplex.dataflow.graph import EPS, Graph
from omni_trainer.multiplex.dataflow.schedule import DataflowError, LLMOp, stage_ops
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, EncoderMicroBatch, Slot
from omni_trainer.multiplex.dataflow.validate import validate_dataflow

__all__ = ["FIXED_POLICIES", "fixed_table"]

FIXED_POLICIES: Final = ("uniform", "front_loaded", "stage0")
"""The policies that place without a search; the first (``uniform``) sets ``auto``'s default
budget."""


def fixed_table(policy: str, proto: DataflowTable) -> DataflowTable:
    """The validated table of one of :data:`FIXED_POLICIES` for ``proto``'s layout and encoder
    mbs (``proto``'s slots are ignored; its structure must have been checked)."""
    pp, vpp, m, mbs = proto.pp, proto.vpp, proto.num_microbatches, proto.encoder_mbs
    if policy == "stage0":
        ops0 = stage_ops(stage=0, pp=pp, vpp=vpp, num_microbatches=m)
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
    else:
        raise DataflowError(f"{policy!r} is not a fixed policy ({', '.join(FIXED_POLICIES)})")
    table = DataflowTable(pp, vpp, m, mbs, fwd, bwd, policy=policy)
    validate_dataflow(table)
    return table


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
    """On-demand insertion against the time model (see
    :func:`~omni_trainer.multiplex.dataflow.plan.plan_dataflow`)."""
    pp, n = table.pp, table.num_forward_ops
    g = Graph.weighted(pp, table.vpp, table.num_microbatches)
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
            if delay <= EPS:
                best = (0.0, i)
                break
            if best is None or delay < best[0] - EPS:
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
            if node not in before_grad and times[node] >= ready - EPS:
                idx = i
                break
        bwd[e.id] = Slot(k, idx)
        last[k] = idx
        node = g.slot[(k, idx)]
        g.weight[node] += 2.0 * e.cost
        g.edge(grad, node)
    return fwd, bwd
