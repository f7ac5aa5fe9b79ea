"""Optimizer, LR schedule, gradient sync and clipping for one rank's model."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from omni_trainer.checkpoint.storage import step_name
from omni_trainer.config import LRScheduleConfig, OptimizerConfig
from omni_trainer.distributed import comm


def build_optimizer(
    params: list[nn.Parameter],
    cfg: OptimizerConfig,
    *,
    modules: Mapping[int, str] | None = None,
    origin: Callable[[nn.Parameter], nn.Parameter] = lambda p: p,
) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and norms (1-D parameters), and one group per LR
    multiplier (``optimizer.lrMultipliers``, by the module name ``modules`` gives each id(p));
    each group's ``lr_multiplier`` scales the LR the trainer sets every step. ``origin`` maps a
    main parameter (an fp32 copy, a ZeRO-1 slice) to the model parameter it stands for.
    The update is torch's fused kernel, on CPUs too (measured on CPU, 6.3M parameters in 48
    tensors: fused 56 ms, one tensor at a time 176 ms, foreach 340 ms)."""
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            model = origin(p)
            scale = cfg.lr_multipliers.get((modules or {}).get(id(model), ""), 1.0)
            groups.setdefault((scale, model.ndim >= 2), []).append(p)
    return torch.optim.AdamW(
        [
            {
                "params": ps,
                "weight_decay": cfg.weight_decay if decay else 0.0,
                "lr_multiplier": scale,
            }
            for (scale, decay), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1]))
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
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


def all_reduce_grads(
    grads: list[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    *,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Sum gradients over ``group`` in one flat buffer of ``dtype`` (losses are pre-normalised
    globally)."""
    if comm.size(group) == 1:
        return
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads).to(dtype)
    comm.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


RESUME_SUSPECT_STEPS = 5
"""A non-finite gradient this many steps or fewer after a resume blames the checkpoint loaded
(corrupted, or another run's), not the learning rate: a diverging run rarely turns non-finite
right where it left off."""


def check_finite(
    step: int, loss: float, grad_norm: float, *, resumed_from: int | None = None
) -> None:
    """Stop before a non-finite update reaches the weights and the next checkpoint. The norm is
    the same number on every rank (it is reduced over the whole model), so all ranks stop.

    Raises:
        FloatingPointError: naming the step, the norm and the loss, and what to change (the
            checkpoint resumed from, within :data:`RESUME_SUSPECT_STEPS` of it).
    """
    if math.isfinite(grad_norm):
        return
    if resumed_from is not None and step - resumed_from <= RESUME_SUSPECT_STEPS:
        raise FloatingPointError(
            f"step {step}: the gradient norm is {grad_norm} (loss {loss:.6g}) "
            f"{step - resumed_from} step(s) after resuming from checkpoint step {resumed_from}: "
            f"the checkpoint is the suspect (corrupted, or written by another run), not the "
            f"learning rate; move {step_name(resumed_from)} aside to resume from the one before"
        )
    raise FloatingPointError(
        f"step {step}: the gradient norm is {grad_norm} (loss {loss:.6g}), so the update was "
        "not applied: training diverged; lower optimizer.lr (or lengthen "
        "lrSchedule.warmupSteps) and resume from the last checkpoint"
    )


def _sum_of_squares(grads: list[torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
    """The sum of squares of ``grads`` as a 1-element float64 tensor on their device, computed
    there with multi-tensor norms (no host sync per tensor)."""
    device = grads[0].device if grads else params[0].device if params else torch.device("cpu")
    if not grads:
        return torch.zeros(1, dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum().reshape(1)


def clip_grad_norm(
    llm_params: list[nn.Parameter],
    replicated_params: list[nn.Parameter],
    max_norm: float,
    *,
    tp_rank: int,
    model_parallel_group: dist.ProcessGroup,
    sharded_llm_group: dist.ProcessGroup | None = None,
    sharded_replicated_group: dist.ProcessGroup | None = None,
) -> float:
    """Global grad norm counting each weight once, then clip.

    LLM weights are split over the tensor- and pipeline-parallel ranks of a replica: TP shards and
    stage-local weights are summed over that group, TP-replicated ones (norms) only from TP rank 0.
    With ZeRO-1 (``sharded_llm_group``) each rank of that group holds disjoint slices of the
    LLM gradients, so their squares are summed over it first.
    ``replicated_params`` (encoders) are identical on every rank after their all-reduce, or,
    with ZeRO (``sharded_replicated_group``), held by one owner each and zero elsewhere, so their
    squares are summed over that group.
    """
    llm = [
        p.grad
        for p in llm_params
        if p.grad is not None
        and not getattr(p, "shared", False)  # the last stage's copy of a tied embedding
        and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    ]
    replicated = [p.grad for p in replicated_params if p.grad is not None]
    llm_sq = _sum_of_squares(llm, llm_params)
    if sharded_llm_group is not None:
        comm.all_reduce(llm_sq, group=sharded_llm_group)
    comm.all_reduce(llm_sq, group=model_parallel_group)
    rep_sq = _sum_of_squares(replicated, replicated_params)
    if sharded_replicated_group is not None:
        comm.all_reduce(rep_sq, group=sharded_replicated_group)
    total = math.sqrt(float((llm_sq + rep_sq.to(llm_sq.device)).item()))  # the step's one sync
    if max_norm > 0 and total > max_norm:
        grads = [p.grad for p in (*llm_params, *replicated_params) if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total
