"""Checks that a manifest's layout can run at a world size (torch-free: ``omni plan`` uses it)."""

from __future__ import annotations

from omni_trainer.config import ManifestError, TrainerConfig
from omni_trainer.distributed.config import ParallelDims


def layout_for(cfg: TrainerConfig, world_size: int) -> ParallelDims:
    """The run's layout, or a :class:`ManifestError` naming the field and the fix."""
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as err:
        raise ManifestError(f"spec.trainer.parallelism: {err}") from None
    check_layout(cfg, dims)
    return dims


def check_layout(cfg: TrainerConfig, dims: ParallelDims) -> None:
    """Reject layouts this trainer cannot run, naming the manifest field and the fix."""
    if dims.cp > 1 and cfg.data.seq_length % dims.cp:
        raise ManifestError(
            f"spec.trainer.data.seqLength ({cfg.data.seq_length}) must be a multiple of "
            f"spec.trainer.parallelism.context ({dims.cp}): every context-parallel rank holds "
            "seqLength / context positions of each sequence; change either"
        )
    if cfg.parallelism.sequence_parallel_on and cfg.data.seq_length % dims.tp:
        raise ManifestError(
            f"spec.trainer.data.seqLength ({cfg.data.seq_length}) must be a multiple of "
            f"spec.trainer.parallelism.tensor ({dims.tp}) with sequence parallelism: every "
            "tensor-parallel rank holds seqLength / tensor positions; change either, or set "
            "parallelism.sequenceParallel: false"
        )
    per_step = cfg.data.micro_batch_size * dims.dp
    if cfg.data.global_batch_size % per_step:
        raise ManifestError(
            f"spec.trainer.data.globalBatchSize ({cfg.data.global_batch_size}) must be a "
            f"multiple of microBatchSize x data-parallel size "
            f"({cfg.data.micro_batch_size} x {dims.dp} = {per_step}); "
            "change the batch sizes or --nproc"
        )
    shards, group = cfg.data.shards_for(dims.dp), cfg.data.reorder.group_size
    if shards % dims.dp:
        raise ManifestError(
            f"spec.trainer.data.loaderShards ({shards}) must be a multiple of the data-parallel "
            f"size ({dims.dp}): each data-parallel rank hosts the same number of loaders"
        )
    if dims.dp % group:
        raise ManifestError(
            f"spec.trainer.data.reorder.groupSize ({group}) must divide the data-parallel size "
            f"({dims.dp})"
        )
    num_micro = cfg.data.global_batch_size // per_step
    layers, stages = cfg.model.llm.num_layers, dims.pp * dims.vpp
    if layers % stages:
        raise ManifestError(
            f"spec.trainer.model.llm.numLayers ({layers}) must be a multiple of "
            f"parallelism.pipeline x virtualPipeline ({dims.pp} x {dims.vpp} = {stages})"
        )
    if dims.vpp > 1 and num_micro % dims.pp:
        raise ManifestError(
            f"interleaved pipelining needs micro-batches per step ({num_micro} = "
            f"globalBatchSize / (microBatchSize x data parallel)) to be a multiple of "
            f"spec.trainer.parallelism.pipeline ({dims.pp})"
        )
