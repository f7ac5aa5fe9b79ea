"""Process groups for one run, built once from :class:`ParallelDims` and passed around."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from omni_trainer.distributed.config import ParallelDims
from omni_trainer.mcore.cpu_compat import apply_cpu_compat


@dataclass(frozen=True)
class ProcessGroups:
    """Explicit groups; code below the trainer takes these, never megatron's globals."""

    dims: ParallelDims
    rank: int
    world: dist.ProcessGroup
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp_rank: int
    dp_rank: int
    device: torch.device


def init_distributed(*, timeout_s: int = 600) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or a world of one). NCCL with CUDA, gloo on CPU."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        apply_cpu_compat()
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            store = dist.HashStore()
            dist.init_process_group(
                backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
            )
        else:
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
            )
    return rank, world_size, device


def build_process_groups(dims: ParallelDims, device: torch.device) -> ProcessGroups:
    """Initialise megatron's model-parallel state for ``dims`` and return the groups we use."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        context_parallel_size=dims.cp,
        create_gloo_process_groups=False,
    )
    return ProcessGroups(
        dims=dims,
        rank=dist.get_rank(),
        world=dist.group.WORLD,
        tp=ps.get_tensor_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device,
    )


def seed_everything(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker identically on every rank."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
