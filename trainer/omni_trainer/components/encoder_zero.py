"""ZeRO-2 for the encoders: gradients and optimizer state sharded over all encoder replicas.

Every rank holds a full encoder replica (encoders sit on every pipeline stage), so without
sharding each rank also keeps a full copy of their gradients and Adam moments. Here each encoder
parameter has one owner rank (balanced by size): after the backward, gradients are reduced to the
owner only and freed elsewhere, only owners keep optimizer state and step, and the updated
weights are broadcast from the owners. The math is the one of the unsharded optimizer (Adam is
elementwise), so training is unchanged: only memory and communication move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from omni_trainer.distributed import comm


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank per parameter: largest first onto the least-loaded rank (ties: lower index)."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


class EncoderZero:
    """Owner bookkeeping and the two collectives of a step (reduce grads, broadcast weights)."""

    def __init__(self, params: list[nn.Parameter], *, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        owners = assign_owners([p.numel() for p in params], world)
        self.by_owner: list[list[nn.Parameter]] = [[] for _ in range(world)]
        for p, owner in zip(params, owners, strict=True):
            self.by_owner[owner].append(p)

    @property
    def owned(self) -> list[nn.Parameter]:
        return self.by_owner[self.rank]

    def reduce_gradients(self) -> None:
        """Sum each gradient into its owner; other ranks zero theirs (it is not theirs to keep)."""
        for owner, params in enumerate(self.by_owner):
            if not params:
                continue
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            comm.reduce(flat, dst=owner, group=self.group)
            if owner == self.rank:
                for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    g.copy_(reduced)
            else:
                for g in grads:
                    g.zero_()

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every replica takes the owners' updated weights."""
        for owner, params in enumerate(self.by_owner):
            if not params:
                continue
            flat = _flatten_dense_tensors([p.data for p in params])
            comm.broadcast(flat, src=owner, group=self.group)
            for p, synced in zip(params, _unflatten_dense_tensors(flat, params), strict=True):
                p.data.copy_(synced)
