"""Megatron's op order per pipeline stage: the replica of megatron-core 0.16.1's schedules that
the dataflow table places encoder work against (the order is checked against megatron itself by
``tests/dist/test_megatron_schedule_order.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DataflowError", "LLMOp", "check_layout", "stage_ops"]


class DataflowError(ValueError):
    """A schedule or dataflow table that megatron or the anchor cannot run (with the reason)."""


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
