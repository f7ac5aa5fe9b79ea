"""Parallelism section of the manifest (torch-free)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from omni_trainer.config_base import Spec

_BYTES = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_SCALE = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_SCALE |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def memory_bytes(value: int | str) -> int:
    """Bytes from an integer or a Kubernetes-style quantity (``20Gi``, ``1.5G``, ``512Mi``).

    Raises:
        ValueError: not a positive byte count.
    """
    match = None if isinstance(value, bool) else _BYTES.match(str(value).strip())
    size = float(match[1]) * _SCALE.get(match[2] or "", 1) if match else 0.0
    if size < 1:
        raise ValueError(
            f"parallelism.encoder.memoryBudget {value!r} is not a positive byte count: give bytes "
            "(e.g. 21474836480) or a quantity such as 20Gi, 512Mi or 1.5G, or drop it to derive "
            "the budget from the device's memory"
        )
    return int(size)


class EncoderParallelConfig(Spec):
    """How encoders run next to the LLM (the paper's techniques 2, 5, 6)."""

    eta: int = Field(
        4096, ge=0, description="samples longer than this (tokens) encode sequence-parallel"
    )
    policy: Literal["auto", "uniform", "front_loaded", "stage0"] = Field(
        "auto",
        description="where encoder micro-batches enter the LLM pipeline: auto fills idle "
        "pipeline time first, then front-loads while a stage's encoder activations fit "
        "memoryBudget, then inserts on demand; uniform on-demand insertion on every stage "
        "(the paper's), all before the pipeline, or all on stage 0",
    )
    memory_budget: int | str | None = Field(
        None,
        description="auto: the bytes of encoder activations one rank may hold (bytes or a "
        "quantity such as 20Gi); default: 1.1 x the peak of the uniform policy's table, at "
        "most the device's memory (a GPU's total, or the host's available memory divided by "
        "the local processes) minus the LLM's static bytes and activation peak",
    )
    shared_cores: bool | None = Field(
        None,
        description="auto: whether the pipeline's stages share CPU cores (a local run whose "
        "processes have more threads than the host has cores); then a stage's idle time is "
        "another's compute, so auto does not fill it with encoder work and takes the "
        "front-loaded table wherever it fits memoryBudget; default: detected (false on GPUs)",
    )
    zero: Literal[0, 2] | None = Field(
        None,
        description="2: shard encoder gradients and optimizer state over all encoder replicas "
        "(ZeRO-2); 0: every rank keeps full copies; default: 2 when the LLM's "
        "distributedOptimizer is on, so the whole model's optimizer state is sharded",
    )

    @field_validator("memory_budget")
    @classmethod
    def _budget_in_bytes(cls, v: int | str | None) -> int | str | None:
        if v is not None:
            memory_bytes(v)
        return v

    @property
    def memory_budget_bytes(self) -> int | None:
        """The manifest's budget in bytes; None: derive it from the device."""
        return None if self.memory_budget is None else memory_bytes(self.memory_budget)


class ParallelismConfig(Spec):
    """LLM parallel sizes; data parallel is whatever the world size leaves."""

    tensor: int = Field(1, ge=1, description="tensor-parallel size of the LLM (inside a node)")
    pipeline: int = Field(1, ge=1, description="pipeline stages of the LLM")
    virtual_pipeline: int = Field(1, ge=1, description="model chunks per pipeline stage")
    context: int = Field(1, ge=1, description="context-parallel size of the LLM")
    sequence_parallel: bool | None = Field(
        None,
        description="megatron sequence parallelism inside the tensor-parallel group (norms, "
        "residuals and the stage-0 embeddings sharded along the sequence); default: on when "
        "tensor > 1 (and context is 1)",
    )
    distributed_optimizer: bool | None = Field(
        None,
        description="ZeRO-1 for the LLM: each data-parallel rank keeps the optimizer state "
        "(and fp32 main weights with bf16) of its slice only; gradients are reduce-scattered "
        "and the updated slices all-gathered; default: on when data parallel > 1",
    )
    bucket_size: int = Field(
        40_000_000,
        ge=1,
        description="elements per gradient bucket of the LLM's reduce-scatter / all-gather "
        "(distributedOptimizer)",
    )
    overlap_grad_reduce: bool | None = Field(
        None,
        description="start each gradient bucket's reduce-scatter during the last micro-batch's "
        "backward, as soon as its gradients are final, so the data-parallel sync runs behind the "
        "rest of the backward (megatron's overlap_grad_reduce); needs distributedOptimizer; "
        "default: on with it",
    )
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="the precision the LLM's gradients travel in over the data- (and context-) "
        "parallel group: fp32 (exact sums) or bf16 (half the bytes; each rank accumulates its "
        "micro-batches and keeps the reduced gradients in fp32 either way)",
    )
    encoder: EncoderParallelConfig = EncoderParallelConfig()

    @model_validator(mode="after")
    def _overlap_needs_distributed_optimizer(self) -> ParallelismConfig:
        if self.overlap_grad_reduce and self.distributed_optimizer is False:
            raise ValueError(
                "overlapGradReduce overlaps the distributed optimizer's reduce-scatter: set "
                "distributedOptimizer: true or drop overlapGradReduce"
            )
        return self

    @model_validator(mode="after")
    def _sequence_parallel_fits(self) -> ParallelismConfig:
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError(
                "sequenceParallel shards along the sequence inside the tensor-parallel group: "
                "set tensor > 1 or drop sequenceParallel"
            )
        if self.sequence_parallel and self.context > 1:
            raise ValueError(
                "sequenceParallel with context > 1 is not supported: set sequenceParallel: false "
                "or context: 1"
            )
        return self

    def distributed_optimizer_on(self, data_parallel: int) -> bool:
        """ZeRO-1 for the LLM at this data-parallel size (the default follows it)."""
        if self.distributed_optimizer is None:
            return data_parallel > 1
        return self.distributed_optimizer

    def overlap_grad_reduce_on(self, data_parallel: int) -> bool:
        """The overlapped reduce-scatter at this data-parallel size (the default follows the
        distributed optimizer)."""
        if not self.distributed_optimizer_on(data_parallel):
            return False
        return self.overlap_grad_reduce is not False

    def encoder_zero(self, data_parallel: int) -> int:
        """The encoders' ZeRO stage at this data-parallel size (0 or 2)."""
        if self.encoder.zero is None:
            return 2 if self.distributed_optimizer_on(data_parallel) else 0
        return self.encoder.zero

    @property
    def sequence_parallel_on(self) -> bool:
        if self.sequence_parallel is None:
            return self.tensor > 1 and self.context == 1
        return self.sequence_parallel


@dataclass(frozen=True)
class ParallelDims:
    """The layout of one run, computed once from the manifest and the world size."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of parallelism.tensor x "
                f"pipeline x context = {self.tp} x {self.pp} x {self.cp} = {model}; "
                "change --nproc or the parallel sizes"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, world_size: int) -> ParallelDims:
        return cls(
            world_size=world_size,
            tp=cfg.tensor,
            pp=cfg.pipeline,
            vpp=cfg.virtual_pipeline,
            cp=cfg.context,
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "world_size": self.world_size,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "cp": self.cp,
            "dp": self.dp,
        }

    def describe(self) -> str:
        parts = [f"{k}{v}" for k, v in self.as_dict().items() if k != "world_size" and v > 1]
        return "x".join(parts) or "single"
