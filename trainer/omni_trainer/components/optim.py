"""Optimizer, LR schedule, gradient sync and clipping for one rank's model."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from omni_trainer.config import LRScheduleConfig, OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and norms (1-D parameters)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
    )


def lr_at(step: int, *, opt: OptimizerConfig, sched: LRScheduleConfig, total_steps: int) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then decay to ``min_lr``."""
    if sched.warmup_steps and step < sched.warmup_steps:
        return opt.lr * (step + 1) / sched.warmup_steps
    if sched.decay == "constant":
        return opt.lr
    decay_steps = max(1, (sched.decay_steps or total_steps) - sched.warmup_steps)
    frac = min(1.0, (step - sched.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * frac))
    coeff = 1.0 - frac if sched.decay == "linear" else cosine
    return opt.min_lr + (opt.lr - opt.min_lr) * coeff


def all_reduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum gradients over ``group`` in one flat buffer (losses are pre-normalised globally)."""
    if dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def clip_grad_norm(
    params: list[nn.Parameter], max_norm: float, *, tp_group: dist.ProcessGroup
) -> float:
    """Global grad norm counting each weight once: TP shards are summed over the TP group,
    replicated parameters (norms, encoders) are counted on every rank but only once in total."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if dist.get_world_size(tp_group) > 1:
        device = params[0].device
        sharded_dev = sharded.to(device)
        dist.all_reduce(sharded_dev, group=tp_group)
        sharded = sharded_dev.cpu()
    total = math.sqrt(float(sharded + replicated))
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return total
