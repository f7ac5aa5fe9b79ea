"""Mixed precision: bf16 LLM weights and compute, fp32 main weights and gradients (megatron's).

With ``precision: bf16`` the LLM chunks hold bf16 parameters (so every layer emits bf16 and the
pipeline carries bf16), while the optimizer, the gradient sync and the clipping see fp32 *main*
parameters: each bf16 parameter has an fp32 twin, its micro-batch gradients are accumulated into
the twin's fp32 gradient as soon as autograd produces them (the bf16 gradient is then dropped),
and after the optimizer step the twins are copied back into the bf16 weights. Encoders keep fp32
weights and compute under bf16 autocast. Checkpoints hold the fp32 main weights, so a checkpoint
moves between precisions unchanged.

fp32 runs use the parameters themselves: :class:`MainParams` is then the identity. With
``parallelism.distributedOptimizer`` the main weights are sharded instead
(``components/distributed_optimizer.py``, the same interface).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from omni_trainer.checkpoint.flat_shards import FlatShard
from omni_trainer.components.optim import all_reduce_grads

# the megatron attributes that say how a parameter is sharded (read by clipping and checkpoints)
_SHARDING_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel",
    "shared",  # the last stage's copy of a tied embedding
    "shared_embedding",
)


def copy_sharding_attrs(source: nn.Parameter, target: nn.Parameter) -> nn.Parameter:
    """``target`` says how it is sharded as ``source`` does (clipping and checkpoints read it)."""
    for attr in _SHARDING_ATTRS:
        if hasattr(source, attr):
            setattr(target, attr, getattr(source, attr))
    return target


@dataclass(frozen=True)
class CheckpointView:
    """What a checkpoint saves and loads of the LLM: fp32 weights per parameter, whole or
    (ZeRO-1) this rank's flat range.

    Attributes:
        full: id(model parameter) -> the whole fp32 tensor standing for it in a checkpoint.
        optimizer: its ``state`` maps those tensors (and the encoders') to their slots.
        loaded: call after a load fills ``full`` and ``optimizer.state``: the values reach the
            model, the main weights and the real optimizer.
        flat: id(model parameter) -> this rank's range of it (ZeRO-1; then not in ``full``).
    """

    full: Mapping[int, nn.Parameter]
    optimizer: Any
    loaded: Callable[[], None]
    flat: Mapping[int, FlatShard] = field(default_factory=dict)


def compute_dtype(precision: Literal["auto", "fp32", "bf16"], device: torch.device) -> torch.dtype:
    """bf16 when asked, or by default on GPUs; fp32 otherwise."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def encoder_autocast(dtype: torch.dtype, device: torch.device) -> AbstractContextManager:
    """Encoders compute in ``dtype`` over fp32 weights (autograd keeps the casts)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class MainParams:
    """fp32 main parameters (and gradients) of low-precision model parameters."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``reduce_dtype``: what the gradients travel in over ``group``."""
        self.model_params = params
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.main: list[nn.Parameter] = []
        self._main_of: dict[int, nn.Parameter] = {}
        for p in params:
            if p.dtype == torch.float32:
                main = p
            else:
                main = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                copy_sharding_attrs(p, main)
                p.register_post_accumulate_grad_hook(self._accumulate(main))
            main.grad = torch.zeros_like(main)
            self.main.append(main)
            self._main_of[id(p)] = main
        self._origin = {id(m): p for p, m in zip(params, self.main, strict=True)}

    @staticmethod
    def _accumulate(main: nn.Parameter):
        def hook(p: nn.Parameter) -> None:
            main.grad.add_(p.grad)  # fp32 accumulation over micro-batches
            p.grad = None

        return hook

    # -- the step (the interface of ``distributed_optimizer.DistributedMainParams``) ----------
    norm_group = None  # the main gradients are whole on every rank

    def origin_of(self, main: nn.Parameter) -> nn.Parameter:
        """The model parameter a main parameter stands for (its LR group, weight decay)."""
        return self._origin[id(main)]

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.main_of(param).grad

    def zero_grad(self) -> None:
        for m in self.main:
            m.grad.zero_()

    def expect_backwards(self, micro_batches: int) -> None:
        """Nothing to arm: the whole all-reduce runs after the backward."""

    def reduce_gradients(self) -> None:
        """Sum the main gradients over the data- (and context-) parallel group."""
        all_reduce_grads([m.grad for m in self.main], self.group, dtype=self.reduce_dtype)

    def step_done(self) -> None:
        self.copy_to_model()

    def full_grads(self) -> dict[int, torch.Tensor]:
        return {id(p): m.grad for p, m in zip(self.model_params, self.main, strict=True)}

    def checkpoint_view(self, optimizer: torch.optim.Optimizer) -> CheckpointView:
        """The main weights and the optimizer as they are; a load is copied into the model."""
        full = {id(p): m for p, m in zip(self.model_params, self.main, strict=True)}
        return CheckpointView(full=full, optimizer=optimizer, loaded=self.copy_to_model)

    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
        """id(model param) -> its fp32 main weight (``param``) and optimizer slots (tests)."""
        return {
            id(p): {"param": m.detach(), **optimizer.state.get(m, {})}
            for p, m in zip(self.model_params, self.main, strict=True)
        }

    def main_of(self, param: nn.Parameter) -> nn.Parameter:
        """The fp32 main parameter of ``param`` (``param`` itself: fp32, or frozen)."""
        return self._main_of.get(id(param), param)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The model's weights become the (rounded) main weights: after a step or a load."""
        for p, main in zip(self.model_params, self.main, strict=True):
            if p is not main:
                p.copy_(main)

    def bytes(self) -> dict[str, int]:
        """Bytes of model weights, fp32 main copies and every gradient this object holds."""
        model = sum(p.numel() * p.element_size() for p in self.model_params)
        extra = [m for p, m in zip(self.model_params, self.main, strict=True) if m is not p]
        return {
            "params_bytes": model + sum(m.numel() * m.element_size() for m in extra),
            "grads_bytes": sum(m.grad.numel() * m.grad.element_size() for m in self.main),
        }
