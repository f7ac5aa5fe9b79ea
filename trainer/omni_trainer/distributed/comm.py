"""The one module that calls torch.distributed collectives and point-to-point operations.

Why one place: on GPUs the job's groups carry two backends (``cpu:gloo,cuda:nccl``, see
:func:`omni_trainer.mcore.parallel.init_distributed`), and a tensor must sit on the device of the
backend that should carry it. Here:

- tensor collectives stage their tensors on the group's communication device (the current GPU
  when the group has NCCL, the CPU otherwise) and copy results back where the caller keeps them,
  so a CPU scalar (a loss sum, a token count) never reaches NCCL;
- object exchanges (sequence metadata, pickled sequences, loader states) travel as CPU tensors,
  i.e. over the gloo side of the group;
- :func:`warm_up_pairs` creates the lazily built NCCL pair communicators before step 1, in the
  same order on both ends, so the first step cannot deadlock on their creation.

``tests/unit/distributed/test_comm_owner.py`` fails when a collective is called anywhere else.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None


def size(group: Group = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def comm_device(group: Group = None) -> torch.device:
    """Where a tensor must live to travel over ``group``: the current GPU when it has NCCL."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _staged(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` itself when it can travel as is, else a contiguous copy on ``device``."""
    return tensor.to(device).contiguous()  # both return ``tensor`` itself when they can


def _write_back(tensor: Tensor, staged: Tensor) -> Tensor:
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


# -- tensor collectives -------------------------------------------------------------------------
def all_reduce(tensor: Tensor, *, group: Group = None, op: str = "sum") -> Tensor:
    """Reduce ``tensor`` in place over ``group`` (``op``: sum, max or min); returns it."""
    if size(group) == 1:
        return tensor
    staged = _staged(tensor, comm_device(group))
    dist.all_reduce(staged, op=_OPS[op], group=group)
    return _write_back(tensor, staged)


def all_gather(tensor: Tensor, *, group: Group) -> list[Tensor]:
    """Every rank's ``tensor`` (same shape everywhere), in group-rank order, on its device."""
    staged = _staged(tensor, comm_device(group))
    parts = [torch.empty_like(staged) for _ in range(size(group))]
    dist.all_gather(parts, staged, group=group)
    return [p.to(tensor.device) for p in parts]


def all_gather_flat(tensor: Tensor, *, group: Group) -> Tensor:
    """Every rank's 1-D ``tensor`` concatenated in group-rank order (one buffer, on its device)."""
    if size(group) == 1:
        return tensor.clone()
    device = comm_device(group)
    staged = _staged(tensor, device)
    if device.type == "cuda":
        out = staged.new_empty(staged.numel() * size(group))
        dist.all_gather_into_tensor(out, staged, group=group)
        return out.to(tensor.device)
    out = staged.new_empty(staged.numel() * size(group))
    dist.all_gather(list(out.chunk(size(group))), staged, group=group)  # gloo: no _into_tensor
    return out.to(tensor.device)


def reduce_scatter(tensor: Tensor, *, group: Group) -> Tensor:
    """Sum ``tensor`` over ``group`` and return this rank's equal slice along dim 0."""
    n, rank = size(group), dist.get_rank(group)
    rows = tensor.shape[0] // n
    device = comm_device(group)
    staged = _staged(tensor, device)
    if device.type == "cuda":
        out = staged.new_empty((rows, *staged.shape[1:]))
        dist.reduce_scatter_tensor(out, staged, group=group)
        return out.to(tensor.device)
    total = staged.clone() if staged is tensor else staged
    dist.all_reduce(total, group=group)  # gloo has no reduce-scatter
    return total[rank * rows : (rank + 1) * rows].to(tensor.device)


class PendingReduceScatter:
    """A reduce-scatter under way (:func:`reduce_scatter_start`); :meth:`wait` gives the slice."""

    def __init__(self, work: dist.Work, result: Tensor, home: torch.device) -> None:
        self._work, self._result, self._home = work, result, home

    def wait(self) -> Tensor:
        """This rank's summed slice, on the caller's device (the current stream waits for it)."""
        self._work.wait()
        return self._result.to(self._home)


def reduce_scatter_start(tensor: Tensor, *, group: Group) -> PendingReduceScatter:
    """Start :func:`reduce_scatter` of a 1-D ``tensor`` and return at once: the gradient buckets
    of the distributed optimizer overlap it with the rest of the backward. ``tensor`` must not
    change until :meth:`PendingReduceScatter.wait` returns."""
    n, rank = size(group), dist.get_rank(group)
    rows = tensor.shape[0] // n
    device = comm_device(group)
    staged = _staged(tensor, device)
    if device.type == "cuda":
        out = staged.new_empty(rows)
        work = dist.reduce_scatter_tensor(out, staged, group=group, async_op=True)
        return PendingReduceScatter(work, out, tensor.device)
    total = staged.clone() if staged is tensor else staged
    work = dist.all_reduce(total, group=group, async_op=True)  # gloo has no reduce-scatter
    return PendingReduceScatter(work, total[rank * rows : (rank + 1) * rows], tensor.device)


def all_to_all_single(
    output: Tensor,
    input: Tensor,
    *,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    group: Group,
) -> Tensor:
    """``input``'s i-th chunk (dim 0) goes to rank i; ``output`` is filled in rank order."""
    device = comm_device(group)
    staged_out = _staged(output, device)
    dist.all_to_all_single(
        staged_out,
        _staged(input, device),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
    )
    return _write_back(output, staged_out)


def broadcast(tensor: Tensor, *, src: int, group: Group = None) -> Tensor:
    """In place: ``tensor`` of group rank ``src`` everywhere."""
    if size(group) == 1:
        return tensor
    staged = _staged(tensor, comm_device(group))
    dist.broadcast(staged, group_src=src, group=group)
    return _write_back(tensor, staged)


def reduce(tensor: Tensor, *, dst: int, group: Group) -> Tensor:
    """Sum into group rank ``dst``'s ``tensor`` (other ranks' copies are left undefined)."""
    if size(group) == 1:
        return tensor
    staged = _staged(tensor, comm_device(group))
    dist.reduce(staged, group_dst=dst, group=group)
    return _write_back(tensor, staged)


def barrier(group: Group = None) -> None:
    if size(group) > 1:
        dist.barrier(group=group)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# -- point to point -----------------------------------------------------------------------------
def isend(tensor: Tensor, *, dst: int, group: Group, tag: int = 0) -> dist.Work:
    """Non-blocking send to global rank ``dst``; keep ``tensor`` alive until the work is done.

    Tensors must already sit on the group's device (the anchor allocates them there): a staged
    copy would be freed while the send is still reading it.
    """
    _require_on_comm_device(tensor, group)
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: Tensor, *, src: int, group: Group, tag: int = 0) -> dist.Work:
    """Non-blocking receive from global rank ``src`` into ``tensor`` (on the group's device)."""
    _require_on_comm_device(tensor, group)
    return dist.irecv(tensor, src, group=group, tag=tag)


def _require_on_comm_device(tensor: Tensor, group: Group) -> None:
    device = comm_device(group)
    if tensor.device.type != device.type:
        raise ValueError(
            f"a point-to-point tensor on {tensor.device} cannot travel over a group on {device}: "
            "allocate it on the group's device"
        )


def warm_up_pairs(channels: Iterable[tuple[Group, int]]) -> None:
    """Create the NCCL pair communicator of each (group, global peer rank) now rather than
    inside a step: one element from the lower rank of the pair to the higher. Both ends must
    list each pair, in an order every rank agrees on (NCCL builds a communicator with both
    ends blocking)."""
    me, works, bufs = dist.get_rank(), [], []
    for group, peer in channels:
        bufs.append(torch.zeros(1, device=comm_device(group)))
        if me < peer:
            works.append(isend(bufs[-1], dst=peer, group=group))
        else:
            works.append(irecv(bufs[-1], src=peer, group=group))
    for work in works:
        work.wait()


# -- timed exchanges (the network preflight) ---------------------------------------------------
def new_group(*, timeout_s: float) -> Group:
    """A group over the whole world whose operations give up after ``timeout_s``: the preflight
    names a node that does not answer instead of hanging on it."""
    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def _timed(once: Callable[[], None], device: torch.device, iterations: int) -> float:
    """Seconds per call of ``once`` after one warm-up (which also waits for the peers)."""
    once()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        once()
    _synchronize(device)
    return (time.perf_counter() - start) / iterations


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_exchange(
    peer: int, *, nbytes: int, iterations: int, groups: tuple[Group, Group], timeout_s: float
) -> float | None:
    """Seconds per simultaneous send and receive of ``nbytes`` with global rank ``peer``, or
    None when the peer did not answer within ``timeout_s`` (each wait is bounded).

    Unbatched, so only the pair's communicators take part (a batch that is a group's first
    operation must be entered by every rank of the group). The lower rank sends over
    ``groups[0]`` and receives over ``groups[1]``, the higher the other way round: each pair
    communicator carries one way, in the same order on both ends, and both ways run at once."""
    device = comm_device(groups[0])
    out = torch.ones(max(nbytes // 4, 1), device=device)
    into = torch.empty_like(out)
    bound = timedelta(seconds=timeout_s)
    send_group, recv_group = groups if dist.get_rank() < peer else groups[::-1]

    def once() -> None:
        works = [isend(out, dst=peer, group=send_group), irecv(into, src=peer, group=recv_group)]
        for work in works:
            work.wait(bound)

    try:
        return _timed(once, device, iterations)
    except RuntimeError:  # gloo's and NCCL's timeouts (DistBackendError is one)
        return None


def timed_collective(
    kind: Literal["all_reduce", "all_gather"], *, nbytes: int, iterations: int, group: Group
) -> float:
    """Seconds per all-reduce of ``nbytes`` (all-gather: ``nbytes`` gathered in all, as
    nccl-tests counts it) over ``group`` on its communication device, as this rank saw it."""
    device, n = comm_device(group), size(group)
    if kind == "all_reduce":
        data = torch.zeros(max(nbytes // 4, 1), device=device)
        return _timed(lambda: dist.all_reduce(data, group=group), device, iterations)
    part = torch.ones(max(nbytes // 4 // n, 1), device=device)
    parts = [torch.empty_like(part) for _ in range(n)]  # gloo has no all_gather_into_tensor
    return _timed(lambda: dist.all_gather(parts, part, group=group), device, iterations)


# -- object exchanges (CPU tensors: the gloo side of the group) --------------------------------
def all_gather_object(obj: Any, *, group: Group = None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order."""
    if size(group) == 1:
        return [obj]
    out: list[Any] = [None] * size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, *, src: int = 0, group: Group = None) -> Any:
    """Group rank ``src``'s ``obj`` on every rank."""
    if size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=src, group=group)
    return box[0]


def exchange_objects(outgoing: list[Any], *, group: Group) -> list[Any]:
    """All-to-all of picklable objects: ``outgoing[i]`` goes to group rank i; returns what each
    rank sent here, in rank order. Two CPU all-to-alls (sizes, then bytes) over gloo."""
    payloads = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=recv_sizes.tolist(),
        input_split_sizes=send_sizes.tolist(),
        group=group,
    )
    return [pickle.loads(c.numpy().tobytes()) for c in torch.split(recv, recv_sizes.tolist())]
