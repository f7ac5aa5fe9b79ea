"""A dataflow table as text (``omni plan``): each stage's LLM ops with the encoder work at each
slot, and the paper's notation."""

from __future__ import annotations

from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable

__all__ = ["format_dataflow"]


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
