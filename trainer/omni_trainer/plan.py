"""``omni plan``: how a job's first steps would run, without building a model (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from omni_trainer.config import TrainerConfig
from omni_trainer.data.loader import MultimodalStream
from omni_trainer.data.packing import dp_slice, split_micro_batches
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.distributed.layout import layout_for
from omni_trainer.multiplex.dataflow import DataflowTable, plan_dataflow, simulate
from omni_trainer.multiplex.workload import encoder_micro_batches


@dataclass(frozen=True)
class StepPlan:
    dims: ParallelDims
    table: DataflowTable
    simulation: dict
    sequence_parallel_items: int
    data_parallel_items: int


def plan_step(
    cfg: TrainerConfig, *, world_size: int, step: int = 0, policy: str | None = None
) -> StepPlan:
    """The dataflow table of data-parallel replica 0 at ``step``, as the trainer would plan it."""
    dims = layout_for(cfg, world_size)
    stream = MultimodalStream(
        cfg.data,
        seed=cfg.seed,
        vocab_size=cfg.model.llm.vocab_size,
        geometry=cfg.media_geometry(),
    )
    for _ in range(step):
        stream.next_global_batch()
    local = dp_slice(stream.next_global_batch(), 0, dims.dp)
    micro = split_micro_batches(local, cfg.data.micro_batch_size)
    mbs, lengths = encoder_micro_batches(cfg.model, micro, stages=dims.pp * dims.vpp)
    table = plan_dataflow(
        policy or cfg.parallelism.encoder.policy,
        pp=dims.pp,
        vpp=dims.vpp,
        num_microbatches=len(micro),
        encoder_mbs=mbs,
    )
    eta = cfg.parallelism.encoder.eta
    sp = sum(n > eta for items in lengths.values() for n in items)
    dp_items = sum(n <= eta for items in lengths.values() for n in items)
    return StepPlan(
        dims=dims,
        table=table,
        simulation=simulate(table),
        sequence_parallel_items=sp,
        data_parallel_items=dp_items,
    )
