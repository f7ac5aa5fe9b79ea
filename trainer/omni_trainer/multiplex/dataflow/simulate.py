"""A table's step in the unit time model: busy, idle and makespan per stage, and the peak of
encoder activations each stage holds.

The simulators' fidelity ladder
-------------------------------
Three simulators run a dataflow table's step; each answers its own question:

1. This one (:func:`simulate`), the first rung: which of two tables is better in the planners'
   own model (an LLM forward 1, a backward 2, an encoder mb its ``cost`` and twice that back,
   free p2p, a device per stage, no bytes beyond encoder activations). It is the longest path
   of the happens-before graph the planners search, at slot granularity: an encoder output
   counts when its whole slot ends, and a slot with a backward waits for that gradient, so its
   makespan is never below the second rung's on the same op times.
2. :mod:`omni_trainer.planner.simulate`, the second: how fast and how large one step of a job
   is on a device that is not here (op seconds and bytes from the cost model and a device
   profile, p2p latencies, LLM and encoder memory, the gradient sync); ``omni plan --tune``.
3. :mod:`omni_trainer.multiplex.replay`, the third: why a step measured on this machine took
   what it did (per-op seconds fit to the trainer's timers, stages sharing cores, 1F1B's
   rendezvous p2p, op-time spread, input preparation); the multiplexing bench.
"""

from __future__ import annotations

from typing import Any

from omni_trainer.multiplex.dataflow.graph import graph_of
from omni_trainer.multiplex.dataflow.table import DataflowTable, stage_peaks
from omni_trainer.multiplex.dataflow.validate import validate_dataflow

__all__ = ["simulate"]


def simulate(table: DataflowTable, *, f: float = 1.0, b: float = 2.0) -> dict[str, Any]:
    """Per-stage busy/idle time and makespan of the joint schedule in the simple time model
    (LLM forward op f, backward op b, encoder forward cost*f, backward cost*b, free p2p), plus
    each stage's peak of live encoder activations (sum of :attr:`EncoderMicroBatch.memory` of mbs
    forwarded, not yet backwarded): the memory that on-demand insertion saves and the time model
    does not see."""
    validate_dataflow(table)
    g = graph_of(table, f=f, b=b)
    start = g.start_times()
    assert start is not None
    makespan = g.makespan(start)
    stages, peaks = [], stage_peaks(table)
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
