"""The model on this rank and how it is parallelised: the builder of ``model`` (with the
precision and recompute of ``train``) and of the ``parallelism`` choices that shape parameters,
gradients and their sync (ZeRO-1 for the LLM, ZeRO-2 for the encoders).

:class:`ModelParts` then owns the gradient-side work of a step: the sync after the backward, the
global norm and clipping, the optimizer it is built for, and the weight sync after the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omni_trainer.components.distributed_optimizer import DistributedMainParams
from omni_trainer.components.encoder_zero import EncoderZero
from omni_trainer.components.memory import optimizer_state_bytes, tensor_bytes
from omni_trainer.components.optim import all_reduce_grads, build_optimizer, clip_grad_norm
from omni_trainer.components.precision import MainParams, compute_dtype
from omni_trainer.config import OptimizerConfig, TrainerConfig
from omni_trainer.mcore.parallel import ProcessGroups
from omni_trainer.models.freeze import parameter_modules
from omni_trainer.models.llm import (
    LLMRuntime,
    all_reduce_tied_embedding_grads,
    tied_embedding_copies,
)
from omni_trainer.models.omni import OmniModel
from omni_trainer.models.recompute import Recompute


@dataclass
class ModelParts:
    """The model, its LLM main parameters and the encoders' trainable parameters on this rank.

    Attributes:
        model: encoders, projectors and this rank's LLM chunks.
        chunks: the LLM model chunks (several with virtual pipeline stages).
        main: fp32 main parameters of the LLM (sharded with ``distributedOptimizer``).
        encoder_params: trainable encoder and projector parameters (replicated everywhere).
        encoder_zero: their ZeRO-2 owners, or None.
        sequence_parallel_params: LLM parameters whose gradients are partial per TP rank.
        dtype: the compute dtype (bf16 or fp32).
    """

    model: OmniModel
    chunks: list
    main: MainParams | DistributedMainParams
    encoder_params: list[nn.Parameter]
    encoder_zero: EncoderZero | None
    sequence_parallel_params: list[nn.Parameter]
    dtype: torch.dtype
    groups: ProcessGroups

    def build_optimizer(self, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        """One AdamW over the LLM main parameters and the encoder parameters this rank owns."""
        owned = self.encoder_zero.owned if self.encoder_zero else self.encoder_params
        mains = {id(m) for m in self.main.main}
        return build_optimizer(
            [*self.main.main, *owned],
            cfg,
            modules=parameter_modules(self.model),  # lrMultipliers, by module
            origin=lambda p: self.main.origin_of(p) if id(p) in mains else p,
        )

    def zero_grad(self) -> None:
        """Gradients exist from the start (zeros where a modality is absent), as in megatron's
        buffers: every rank syncs the same tensors, whatever its batch held."""
        self.main.zero_grad()
        for p in self.encoder_params:
            p.grad.zero_()

    def expect_backwards(self, micro_batches: int) -> None:
        """The step runs ``micro_batches`` backwards: the overlapped gradient sync (if on)
        starts a bucket once its gradients are final."""
        self.main.expect_backwards(micro_batches)

    def reduce_gradients(self) -> None:
        """After the last backward: data x context parallel sums (their buckets may have started
        during the backward), then the partial sums of sequence parallel (TP) and of tied
        embeddings (first and last stage) on what each rank keeps, as megatron's
        ``finalize_model_grads``; encoders over all."""
        grad_of = self.main.grad_of
        self.main.reduce_gradients()
        all_reduce_grads([grad_of(p) for p in self.sequence_parallel_params], self.groups.tp)
        all_reduce_tied_embedding_grads(self.chunks, grad_of=grad_of)
        if self.encoder_zero:
            self.encoder_zero.reduce_gradients()
        else:
            all_reduce_grads([p.grad for p in self.encoder_params], self.groups.world)

    def clip(self, max_norm: float) -> float:
        """The global gradient norm (each weight once), clipped to ``max_norm`` (0: never)."""
        return clip_grad_norm(
            self.main.main,
            self.encoder_params,
            max_norm,
            tp_rank=self.groups.tp_rank,
            model_parallel_group=self.groups.model_parallel,
            sharded_llm_group=self.main.norm_group,
            sharded_replicated_group=self.groups.world if self.encoder_zero else None,
        )

    def sync_parameters(self) -> None:
        """After the update: the new weights reach the model copies on every rank."""
        self.main.step_done()
        if self.encoder_zero:
            self.encoder_zero.broadcast_parameters()

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of weights (main copies included), gradients and optimizer state here."""
        figures = self.main.bytes()
        figures["params_bytes"] += tensor_bytes(self.encoder_params)
        figures["grads_bytes"] += tensor_bytes(p.grad for p in self.encoder_params)
        figures["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
        return figures


def build_model_parts(cfg: TrainerConfig, groups: ProcessGroups) -> ModelParts:
    """The model of ``cfg.model`` on ``groups.device``, in ``train.precision`` with
    ``train.recompute``, and its parameters arranged for ``parallelism``. Frozen parameters
    (``freeze``) take no part: no gradient, optimizer state or sync."""
    dims, par = groups.dims, cfg.parallelism
    dtype = compute_dtype(cfg.train.precision, groups.device)
    model = OmniModel(
        cfg.model,
        max_sequence_length=cfg.data.seq_length,
        seed=cfg.seed,
        llm_runtime=LLMRuntime(
            params_dtype=dtype,
            recompute=Recompute(cfg.train.recompute, cfg.train.recompute_layers),
            sequence_parallel=par.sequence_parallel_on,
        ),
    ).to(groups.device)
    trainable = [p for p in model.llm_parameters() if p.requires_grad]
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[par.grad_reduce_dtype]
    main = (
        DistributedMainParams(
            trainable,
            group=groups.dp_cp,
            bucket_numel=par.bucket_size,
            overlap=par.overlap_grad_reduce_on(dims.dp),
            alone=frozenset(id(p) for p in tied_embedding_copies(model.llm_chunks)),
            reduce_dtype=reduce_dtype,
        )
        if par.distributed_optimizer_on(dims.dp)
        else MainParams(trainable, group=groups.dp_cp, reduce_dtype=reduce_dtype)
    )
    encoder_params = [p for p in model.encoder_parameters() if p.requires_grad]
    for p in encoder_params:
        p.grad = torch.zeros_like(p)
    return ModelParts(
        model=model,
        chunks=list(model.llm_chunks),
        main=main,
        encoder_params=encoder_params,
        encoder_zero=(
            EncoderZero(encoder_params, group=groups.world)
            if par.encoder_zero(dims.dp) == 2
            else None
        ),
        sequence_parallel_params=[p for p in trainable if getattr(p, "sequence_parallel", False)],
        dtype=dtype,
        groups=groups,
    )
