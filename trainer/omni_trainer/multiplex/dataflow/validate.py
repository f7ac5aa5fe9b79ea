"""Whether megatron and the anchor can run a dataflow table, and if not, why: one slot pair per
encoder micro-batch on one stage, ascending micro-batch order per stage and direction, and no
cycle through stage 0's ``F(m, 0)`` or ``B(m, 0)`` (each error names the mb, its slot and the
dependency path that would deadlock)."""

from __future__ import annotations

import itertools

from omni_trainer.multiplex.dataflow.graph import graph_of
from omni_trainer.multiplex.dataflow.schedule import DataflowError, LLMOp, check_layout
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, Slot

__all__ = ["check_structure", "validate_dataflow"]


def check_structure(table: DataflowTable) -> None:
    """Raise :class:`DataflowError` unless the table is well formed: a layout megatron runs, unique
    ids, micro-batches in range, non-negative costs, and one forward and one backward slot per mb,
    both existing and on the same stage."""
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
    check_structure(table)
    _check_order(table)
    g = graph_of(table)
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
