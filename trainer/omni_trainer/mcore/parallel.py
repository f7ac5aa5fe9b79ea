"""Process groups for one run, built once from :class:`ParallelDims` and passed around."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from omni_trainer.distributed import comm, strict
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.mcore.cpu_compat import apply_cpu_compat


@dataclass(frozen=True)
class ProcessGroups:
    """Explicit groups; code below the trainer takes these, never megatron's globals."""

    dims: ParallelDims
    rank: int
    world: dist.ProcessGroup
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup  # data-parallel replicas at this (tp, cp, pp) position: same data
    cp: dist.ProcessGroup  # context-parallel ranks: one micro-batch's tokens split among them
    dp_cp: dist.ProcessGroup  # dp x cp: the LLM gradients are summed over these
    model_parallel: dist.ProcessGroup  # tp x pp ranks of one replica: sums the grad norm
    tp_rank: int
    dp_rank: int
    cp_rank: int
    device: torch.device
    anchor: object  # multiplex.anchor.AnchorGroups (imported lazily: it needs the groups first)
    reorder: dist.ProcessGroup | None  # this rank's data reorder group (None: no reordering)


def init_distributed(*, timeout_s: int = 600) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or a world of one). On CPU gloo; with CUDA every group carries
    NCCL for CUDA tensors and gloo for CPU ones (object exchanges), see ``distributed.comm``."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl"
    else:
        apply_cpu_compat()
        device, backend = torch.device("cpu"), "gloo"
    strict.install()
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


def build_process_groups(
    dims: ParallelDims, device: torch.device, *, reorder_group_size: int = 1
) -> ProcessGroups:
    """Initialise megatron's model-parallel state for ``dims`` and return the groups we use."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    strict.begin_warm_up()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        context_parallel_size=dims.cp,
        create_gloo_process_groups=False,
    )
    anchor = build_anchor_groups(dims)
    warm_up_p2p(dims, anchor)
    strict.end_warm_up()
    return ProcessGroups(
        dims=dims,
        rank=dist.get_rank(),
        world=dist.group.WORLD,
        tp=ps.get_tensor_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        cp=ps.get_context_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        model_parallel=ps.get_model_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        device=device,
        anchor=anchor,
        reorder=build_reorder_group(dims, reorder_group_size),
    )


def warm_up_p2p(dims: ParallelDims, anchor) -> None:
    """Create every pair communicator the step's unbatched point-to-point ops use, before step 1
    (NCCL builds one lazily at a pair's first op; two ranks building theirs in opposite orders
    inside a step deadlock): megatron's pipeline pairs and the anchor's channels. Every rank
    visits its pairs in one global order (group kind, lower rank, higher rank)."""
    from megatron.core import parallel_state as ps

    me, pairs = dist.get_rank(), []
    if dims.pp > 1:
        pp_group = ps.get_pipeline_model_parallel_group()
        for kind, group, peer in _pipeline_channels(dims, pp_group):
            pairs.append(((kind, min(me, peer), max(me, peer)), group, peer))
    for index, peer in anchor.unbatched_channels():
        pairs.append(((2 + index, min(me, peer), max(me, peer)), anchor.channels[index], peer))
    comm.warm_up_pairs([(group, peer) for _, group, peer in sorted(pairs, key=lambda p: p[0])])


def _pipeline_channels(dims: ParallelDims, pp_group: dist.ProcessGroup) -> list[tuple]:
    """(kind, group, peer) of megatron's unbatched pipeline P2P (``batch_p2p_comm=False``):
    the previous and next stage (a ring under interleaving) over the pipeline group; with two
    stages megatron sends one way over WORLD (read against megatron-core 0.16,
    ``pipeline_parallel/p2p_communication._p2p_ops``)."""
    from megatron.core import parallel_state as ps

    ring = dist.get_process_group_ranks(pp_group)
    stage = ps.get_pipeline_model_parallel_rank()
    peers = set()
    if stage > 0 or dims.vpp > 1:
        peers.add(ring[(stage - 1) % dims.pp])
    if stage < dims.pp - 1 or dims.vpp > 1:
        peers.add(ring[(stage + 1) % dims.pp])
    channels = [(0, pp_group, p) for p in sorted(peers)]
    if dims.pp == 2:
        channels += [(1, dist.group.WORLD, p) for p in sorted(peers)]
    return channels


def seed_everything(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker identically on every rank."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def destroy_groups() -> None:
    """Destroy every process group but the default one (megatron's, the anchor's, the
    checkpoint's...), every rank at the same point. A process that trains several jobs in one
    world would otherwise keep each job's communicators, and gloo's threads with them."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    default = dist.distributed_c10d._get_default_group()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    gc.collect()  # a group's threads end with its last reference (modules, hooks: cycles)


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def global_rank(
    dims: ParallelDims, *, tp_rank: int, dp_rank: int, stage: int, cp_rank: int = 0
) -> int:
    """megatron's rank order tp-cp-ep-dp-pp (ep = 1): tp + TP * (cp + CP * (dp + DP * pp))."""
    return tp_rank + dims.tp * (cp_rank + dims.cp * (dp_rank + dims.dp * stage))


def build_anchor_groups(dims: ParallelDims):
    """Groups of the encoder anchor: who holds stage k of this replica, the encoder SP group of
    each (stage, replica) and the process groups of its own for encoder traffic.

    megatron orders ranks tp-cp-ep-dp-pp: rank = tp + TP * (cp + CP * (dp + DP * pp)). Each
    context-parallel rank runs its own anchor over the whole micro-batch (its stage-0 ranks then
    keep the rows of the positions they hold), so a "replica" here is a (dp, cp) pair.
    Every rank creates every group in the same order, as torch.distributed requires.
    """
    from megatron.core import parallel_state as ps

    from omni_trainer.multiplex.anchor import AnchorGroups

    tp, dp, pp, cp = dims.tp, dims.dp, dims.pp, dims.cp
    rank = dist.get_rank()
    dp_rank = ps.get_data_parallel_rank()
    cp_rank = ps.get_context_parallel_rank()
    stage = ps.get_pipeline_model_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()

    def ranks_of(d: int, c: int, k: int) -> tuple[int, ...]:
        return tuple(global_rank(dims, tp_rank=t, dp_rank=d, stage=k, cp_rank=c) for t in range(tp))

    stage_ranks = tuple(ranks_of(dp_rank, cp_rank, k) for k in range(pp))
    if stage_ranks[stage][tp_rank] != rank:
        raise RuntimeError(f"rank {rank}: megatron's rank order is not tp-cp-dp-pp as assumed")
    sp_group = None
    for k in range(pp):
        for d in range(dp):
            for c in range(cp):
                group = dist.new_group(list(ranks_of(d, c, k)))
                if (d, c, k) == (dp_rank, cp_rank, stage):
                    sp_group = group
    channels = tuple(dist.new_group(list(range(dims.world_size))) for _ in range(4))
    return AnchorGroups(
        rank=rank,
        stage=stage,
        tp_rank=tp_rank,
        stage_ranks=stage_ranks,
        sp_group=sp_group,
        channels=channels,
    )


_P2P_METHODS = (
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
)


def schedule_kwargs(config, timer) -> dict:
    """Arguments for megatron's pipeline schedule that time its p2p waits as ``pipeline_wait``.

    megatron accepts a ``p2p_communicator`` (with its ``pg_collection``); ours is megatron's own
    class with each public call wrapped in a timer span. Nothing inside megatron changes.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return {}
    communicator = P2PCommunicator(pp_group=ps.get_pipeline_model_parallel_group(), config=config)
    for name in _P2P_METHODS:
        method = getattr(communicator, name)

        def timed(*args, _method=method, **kwargs):
            with timer.span("pipeline_wait"):
                return _method(*args, **kwargs)

        setattr(communicator, name, timed)
    pgs = ProcessGroupCollection()
    pgs.tp = ps.get_tensor_model_parallel_group()
    pgs.cp = ps.get_context_parallel_group()
    pgs.embd = ps.get_embedding_group(check_initialized=False)
    pgs.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pgs.pp = ps.get_pipeline_model_parallel_group()
    pgs.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return {"p2p_communicator": communicator, "pg_collection": pgs}


def build_reorder_group(dims: ParallelDims, group_size: int) -> dist.ProcessGroup | None:
    """This rank's reorder group: ``group_size`` consecutive data-parallel ranks at the same
    (tensor, context, pipeline) position. Every position reorders its copy of the data
    identically."""
    from megatron.core import parallel_state as ps

    if group_size == 1:
        return None
    tp, dp, pp, cp = dims.tp, dims.dp, dims.pp, dims.cp
    me = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_context_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank() // group_size,
    )
    mine = None
    for k in range(pp):
        for t in range(tp):
            for c in range(cp):
                for g in range(dp // group_size):
                    members = range(g * group_size, (g + 1) * group_size)
                    ranks = [
                        global_rank(dims, tp_rank=t, dp_rank=d, stage=k, cp_rank=c) for d in members
                    ]
                    group = dist.new_group(ranks)
                    if (t, c, k, g) == me:
                        mine = group
    return mine
