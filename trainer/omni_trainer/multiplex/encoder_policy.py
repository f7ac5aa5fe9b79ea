"""The manifest's ``parallelism.encoder.policy`` applied to a step: the table it chooses.

:func:`step_table` is where the trainer (every step) and ``omni plan`` (one step, offline) turn the
policy into a :class:`~omni_trainer.multiplex.dataflow.table.DataflowTable`. For ``auto`` it needs
the bytes of encoder activations a stage may hold: the device's memory minus the LLM's static bytes
and the peak of its own activations in the pipeline schedule without encoders (like the planner's
:func:`~omni_trainer.planner.simulate.encoder_budget`, from the same cost model,
:mod:`omni_trainer.costs.step_costs`), and whether the stages share CPU cores (then ``auto``
front-loads where that fits). Pure Python except :func:`device_memory_bytes` and
:func:`stages_share_cores` (torch, imported there).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from omni_trainer.costs.step_costs import Layout, llm_activation_bytes, static_memory
from omni_trainer.data.packing import PackedSequence
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.multiplex.dataflow.plan import Policy, plan_dataflow
from omni_trainer.multiplex.dataflow.schedule import stage_ops
from omni_trainer.multiplex.dataflow.table import DataflowTable, EncoderMicroBatch

if TYPE_CHECKING:
    import torch

    from omni_trainer.config import TrainerConfig
    from omni_trainer.distributed.config import EncoderParallelConfig

__all__ = [
    "cores_are_shared",
    "device_memory_bytes",
    "encoder_budget",
    "host_available_bytes",
    "llm_activation_peaks",
    "planning_budget",
    "shares_cores",
    "stages_share_cores",
    "step_table",
    "trainer_layout",
]


def trainer_layout(cfg: TrainerConfig, dims: ParallelDims) -> Layout:
    """The cost model's view of a run (context parallel ranks shard the optimizer state like
    data parallel ones; their share of the tokens is :func:`llm_activation_peaks`')."""
    par = cfg.parallelism
    return Layout(
        tp=dims.tp,
        pp=dims.pp,
        vpp=dims.vpp,
        dp=dims.dp * dims.cp,
        micro_batch_size=cfg.data.micro_batch_size,
        recompute="full" if cfg.train.recompute == "full" else "selective",
        encoder_recompute="full" if cfg.train.recompute == "full" else "selective",
        llm_zero=1 if par.distributed_optimizer_on(dims.dp) else 0,
        overlap_grad_reduce=par.overlap_grad_reduce_on(dims.dp),
        sequence_parallel=par.sequence_parallel_on,
        encoder_zero=2 if par.encoder_zero(dims.dp) == 2 else 0,
    )


def llm_activation_peaks(
    cfg: TrainerConfig,
    layout: Layout,
    micro_batches: Sequence[Sequence[PackedSequence]],
    *,
    context: int = 1,
) -> list[float]:
    """Per stage, the peak bytes of LLM activations held in the step's 1F1B order (each op's
    activations from its forward to its backward, offload's resident layers while it runs);
    ``context`` ranks share each micro-batch's tokens."""
    tokens = [sum(g.length for s in mb for g in s.segments) / context for mb in micro_batches]
    memory = [llm_activation_bytes(cfg.model.llm, t, layout) for t in tokens]
    peaks = []
    for stage in range(layout.pp):
        live = peak = 0.0
        ops = stage_ops(stage=stage, pp=layout.pp, vpp=layout.vpp, num_microbatches=len(tokens))
        for op in ops:
            held, working = memory[op.microbatch][op.chunk * layout.pp + stage]
            live += held if op.kind == "F" else 0.0
            peak = max(peak, live + working)
            live -= held if op.kind == "B" else 0.0
        peaks.append(peak)
    return peaks


def encoder_budget(
    cfg: TrainerConfig,
    dims: ParallelDims,
    micro_batches: Sequence[Sequence[PackedSequence]],
    device_bytes: float,
) -> list[float]:
    """Per stage, ``device_bytes`` minus the LLM's static bytes and activation peak (at least
    0: then ``auto`` holds as few encoder activations as it can)."""
    layout = trainer_layout(cfg, dims)
    peaks = llm_activation_peaks(cfg, layout, micro_batches, context=dims.cp)
    return [
        max(0.0, device_bytes - sum(static_memory(cfg.model, layout, s).values()) - peak)
        for s, peak in enumerate(peaks)
    ]


def host_available_bytes() -> float:
    """The host's available memory (``MemAvailable``), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@functools.cache
def device_memory_bytes(device: torch.device) -> float:
    """The memory one rank may plan with: a GPU's total, or the host's available memory divided
    by the local processes; the least over all ranks (every rank plans the same table), measured
    once per process."""
    import torch

    from omni_trainer.distributed import comm

    if device.type == "cuda":
        mine = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        mine = host_available_bytes() / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        mine = float(comm.all_reduce(torch.tensor([mine], dtype=torch.float64), op="min").item())
    return mine


def cores_are_shared(processes: int, threads: int, cores: int) -> bool:
    """Whether a host's ``processes`` of ``threads`` each outnumber its ``cores``: then the
    stages on it compete for them, and one stage's wait is another's compute."""
    return processes * threads > cores


@functools.cache
def stages_share_cores(device: torch.device) -> bool:
    """Whether any host's ranks share CPU cores (:func:`cores_are_shared` of its local
    processes, this process's threads and the cores it may run on); never on GPUs, where each
    rank has its own device. Agreed over all ranks (every rank plans the same table), measured
    once per process."""
    import torch

    from omni_trainer.distributed import comm

    shared = device.type != "cuda" and cores_are_shared(
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        torch.get_num_threads(),
        len(os.sched_getaffinity(0)),
    )
    flag = torch.tensor([float(shared)], dtype=torch.float64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        flag = comm.all_reduce(flag, op="max")
    return bool(flag.item())


def planning_budget(
    cfg: TrainerConfig,
    dims: ParallelDims,
    micro_batches: Sequence[Sequence[PackedSequence]],
    device_bytes: Callable[[], float],
) -> dict[str, float | list[float]]:
    """``auto``'s budget keywords for :func:`~omni_trainer.multiplex.dataflow.plan.plan_dataflow`
    this step: ``budget``, the manifest's ``memoryBudget`` (it overrides the default), else
    ``device_budget``, the room ``device_bytes()`` leaves beside the LLM (:func:`encoder_budget`;
    called only then), which caps the default (``uniform``'s peak x ``HEADROOM``)."""
    manifest = cfg.parallelism.encoder.memory_budget_bytes
    if manifest is not None:
        return {"budget": float(manifest)}
    return {"device_budget": encoder_budget(cfg, dims, micro_batches, device_bytes())}


def shares_cores(encoder: EncoderParallelConfig, device: torch.device) -> bool:
    """Whether ``auto`` plans for stages that share CPU cores: the manifest's ``sharedCores``,
    else measured (:func:`stages_share_cores`); never for the other policies."""
    if encoder.policy != "auto":
        return False
    return stages_share_cores(device) if encoder.shared_cores is None else encoder.shared_cores


def step_table(
    cfg: TrainerConfig,
    dims: ParallelDims,
    micro_batches: Sequence[Sequence[PackedSequence]],
    encoder_mbs: Sequence[EncoderMicroBatch],
    *,
    device_bytes: Callable[[], float],
    shared_cores: bool,
    policy: Policy | None = None,
) -> DataflowTable:
    """The step's dataflow table under ``policy`` (default: the manifest's), with ``auto``'s
    budget from :func:`planning_budget`."""
    return plan_dataflow(
        policy or cfg.parallelism.encoder.policy,
        pp=dims.pp,
        vpp=dims.vpp,
        num_microbatches=len(micro_batches),
        encoder_mbs=encoder_mbs,
        shared_cores=shared_cores,
        **planning_budget(cfg, dims, micro_batches, device_bytes),
    )
