"""Encoder-LLM multiplexing: the dataflow tables (pure) that the encoder anchor
(:mod:`omni_trainer.components.anchor`) runs.

Importing this package must not import torch: the planner and simulator use it on machines
without one. Torch-side modules live in submodules imported explicitly.
"""

from omni_trainer.multiplex.dataflow import (
    POLICIES,
    POST,
    PRE,
    DataflowError,
    DataflowTable,
    EncoderMicroBatch,
    LLMOp,
    Slot,
    check_layout,
    format_dataflow,
    from_paper_notation,
    plan_dataflow,
    simulate,
    stage_ops,
    validate_dataflow,
)

__all__ = [
    "POLICIES",
    "POST",
    "PRE",
    "DataflowError",
    "DataflowTable",
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
