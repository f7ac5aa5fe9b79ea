"""Checks that a manifest's layout can run at a world size (torch-free: ``omni plan``, ``omni
validate`` and the operator use it before any process starts)."""

from __future__ import annotations

from omni_trainer.config import ManifestError, TrainerConfig
from omni_trainer.data.lengths import Problem, length_problems
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.models.config import ModelConfig


def layout_for(cfg: TrainerConfig, world_size: int) -> ParallelDims:
    """The run's layout, or a :class:`ManifestError` naming every field and its fix."""
    raise_problems(manifest_problems(cfg, world_size))
    return ParallelDims.from_config(cfg.parallelism, world_size)


def check_layout(cfg: TrainerConfig, dims: ParallelDims) -> None:
    """Reject layouts this trainer cannot run, naming the manifest fields and the fixes."""
    raise_problems(dims_problems(cfg, dims))


def raise_problems(problems: list[Problem]) -> None:
    """One :class:`ManifestError` listing every problem as ``spec.trainer.<path>: <message>``."""
    if problems:
        raise ManifestError("\n".join(f"spec.trainer.{p}: {msg}" for p, msg in problems))


def layout_problems(cfg: TrainerConfig, world_size: int) -> list[Problem]:
    """Every reason the manifest cannot run on ``world_size`` processes (empty: it can)."""
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as err:
        return [("parallelism", str(err))]
    return dims_problems(cfg, dims)


def manifest_problems(cfg: TrainerConfig, world_size: int) -> list[Problem]:
    """Every reason the trainer would fail on ``world_size`` processes: the layout, and data
    it would have to cut beyond recognition."""
    return layout_problems(cfg, world_size) + length_problems(cfg.data)[0]


def manifest_warnings(cfg: TrainerConfig) -> list[str]:
    """What the manifest lets through but changes the data (printed before a run starts)."""
    _, warnings = length_problems(cfg.data)
    return [f"spec.trainer.{path}: {msg}" for path, msg in warnings]


def dims_problems(cfg: TrainerConfig, dims: ParallelDims) -> list[Problem]:
    """Every reason the manifest cannot run in layout ``dims`` (model, batch and data splits)."""
    return model_problems(cfg.model, dims) + _batch_problems(cfg, dims)


def model_problems(model: ModelConfig, dims: ParallelDims) -> list[Problem]:
    """Heads split over tensor-parallel ranks, layers over pipeline stages (the planner's
    tuner asks this too, so it proposes only layouts the trainer runs)."""
    llm, out = model.llm, []
    llm_heads = (
        (("numAttentionHeads", llm.num_attention_heads), ("numQueryGroups", llm.num_query_groups))
        if llm.resolved
        else ()  # model.llm.hf not read here (models.config.DEFER_HF): checked where it runs
    )
    for field, value in llm_heads:
        if value % dims.tp:
            out.append(
                (
                    f"model.llm.{field}",
                    f"{field} ({value}) must be a multiple of parallelism.tensor ({dims.tp}): "
                    "every tensor-parallel rank holds the same number of attention heads; "
                    "change the tensor size or the model",
                )
            )
    for modality in ("image", "audio"):
        enc = getattr(model.encoders, modality)
        if enc is not None and enc.resolved and enc.num_heads % dims.tp:
            out.append(
                (
                    f"model.encoders.{modality}.numHeads",
                    f"numHeads ({enc.num_heads}) must be a multiple of parallelism.tensor "
                    f"({dims.tp}): samples longer than parallelism.encoder.eta encode "
                    "sequence-parallel over the stage's tensor-parallel ranks, split by heads",
                )
            )
    layers, stages = llm.num_layers, dims.pp * dims.vpp
    if llm.resolved and layers % stages:
        out.append(
            (
                "model.llm.numLayers",
                f"numLayers ({layers}) must be a multiple of parallelism.pipeline x "
                f"virtualPipeline ({dims.pp} x {dims.vpp} = {stages})",
            )
        )
    return out


def _batch_problems(cfg: TrainerConfig, dims: ParallelDims) -> list[Problem]:
    """Sequences, micro-batches and loaders split evenly over data-parallel ranks."""
    data, out = cfg.data, []
    if dims.cp > 1 and data.seq_length % dims.cp:
        out.append(
            (
                "data.seqLength",
                f"seqLength ({data.seq_length}) must be a multiple of parallelism.context "
                f"({dims.cp}): every context-parallel rank holds seqLength / context positions "
                "of each sequence; change either",
            )
        )
    if cfg.parallelism.sequence_parallel_on and data.seq_length % dims.tp:
        out.append(
            (
                "data.seqLength",
                f"seqLength ({data.seq_length}) must be a multiple of parallelism.tensor "
                f"({dims.tp}) with sequence parallelism: every tensor-parallel rank holds "
                "seqLength / tensor positions; change either, or set "
                "parallelism.sequenceParallel: false",
            )
        )
    per_step = data.micro_batch_size * dims.dp
    if data.global_batch_size % per_step:
        out.append(
            (
                "data.globalBatchSize",
                f"globalBatchSize ({data.global_batch_size}) must be a multiple of "
                f"microBatchSize x data-parallel size ({data.micro_batch_size} x {dims.dp} = "
                f"{per_step}), where data parallel = processes / (tensor x pipeline x "
                "context); change the batch sizes or the number of processes",
            )
        )
    elif dims.vpp > 1 and (data.global_batch_size // per_step) % dims.pp:
        out.append(
            (
                "parallelism.virtualPipeline",
                f"interleaved pipelining needs micro-batches per step "
                f"({data.global_batch_size // per_step} = globalBatchSize / (microBatchSize x "
                f"data parallel)) to be a multiple of parallelism.pipeline ({dims.pp})",
            )
        )
    shards, group = data.shards_for(dims.dp), data.reorder.group_size
    if shards % dims.dp:
        out.append(
            (
                "data.loaderShards",
                f"loaderShards ({shards}) must be a multiple of the data-parallel size "
                f"({dims.dp}): each data-parallel rank hosts the same number of loaders",
            )
        )
    if dims.dp % group:
        out.append(
            (
                "data.reorder.groupSize",
                f"groupSize ({group}) must divide the data-parallel size ({dims.dp})",
            )
        )
    return out
