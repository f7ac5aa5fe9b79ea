"""``omni plan``: how a job's first steps would run, without building a model (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from omni_trainer.config import TrainerConfig
from omni_trainer.data.loader import MultimodalStream, hosted_shards
from omni_trainer.data.packing import split_micro_batches
from omni_trainer.data.sample import media_geometry
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.distributed.layout import layout_for
from omni_trainer.multiplex.dataflow.simulate import simulate
from omni_trainer.multiplex.dataflow.table import DataflowTable
from omni_trainer.multiplex.encoder_policy import host_available_bytes, step_table
from omni_trainer.multiplex.workload import encoder_micro_batches


@dataclass(frozen=True)
class StepPlan:
    dims: ParallelDims
    table: DataflowTable
    simulation: dict
    sequence_parallel_items: int
    data_parallel_items: int


def plan_step(
    cfg: TrainerConfig,
    *,
    world_size: int,
    step: int = 0,
    policy: str | None = None,
    device_bytes: float | None = None,
) -> StepPlan:
    """The dataflow table of data-parallel replica 0 at ``step``, as the trainer would plan it.

    ``auto``'s budget: the manifest's ``memoryBudget``, else ``uniform``'s peak x HEADROOM within
    the room beside the LLM on ``device_bytes`` per rank (None: the host's available memory over
    ``world_size`` processes, as the trainer derives it on one CPU node); the stages on cores of
    their own unless the manifest's ``sharedCores`` says otherwise (as on GPUs)."""
    dims = layout_for(cfg, world_size)
    num_shards = cfg.data.shards_for(dims.dp)
    streams = [  # replica 0's loaders; reordering between replicas is not shown
        MultimodalStream(
            cfg.data,
            seed=cfg.seed,
            vocab_size=cfg.model.llm.vocab_size,
            geometry=media_geometry(cfg.model),
            shard=s,
            num_shards=num_shards,
            tokenizer=cfg.tokenizer,
        )
        for s in hosted_shards(num_shards, 0, dims.dp)
    ]
    for _ in range(step):
        for stream in streams:
            stream.next_batch()
    local = [seq for stream in streams for seq in stream.next_batch()]
    micro = split_micro_batches(local, cfg.data.micro_batch_size)
    mbs, lengths = encoder_micro_batches(cfg.model, micro, stages=dims.pp * dims.vpp)
    table = step_table(
        cfg,
        dims,
        micro,
        mbs,
        device_bytes=lambda: device_bytes or host_available_bytes() / world_size,
        shared_cores=bool(cfg.parallelism.encoder.shared_cores),
        policy=policy,
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
