"""Per-op times and per-rank memory of a multimodal job on a device profile.

Compute time is FLOPs over ``peak x efficiency`` (``devices.EfficiencyTable``), with the FLOPs of
the trainer's own accounting (``components/flops``, the encoder configs' ``flops()``), split into
GEMM and attention parts because they run at different efficiencies. Communication is the
alpha-beta model of ``devices``. Memory follows Megatron's bookkeeping: bf16 parameters, fp32
main gradients, fp32 master weights + Adam moments (sharded over data parallel with the
distributed optimizer, ZeRO-1), activations per Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2: ``34 s b h / t`` bytes per layer with tensor
and sequence parallelism once attention scores are not stored, which FlashAttention guarantees;
``2 s b h / t`` with full recomputation).

Pure Python: the planner runs without torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from omni_trainer.components.flops import attention_flops, transformer_matmul_params
from omni_trainer.data.packing import PackedSequence
from omni_trainer.models.config import LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig
from omni_trainer.multiplex.lssp import plan_lssp
from omni_trainer.planner.devices import (
    DeviceProfile,
    all_gather_time,
    all_to_all_time,
    p2p_time,
    reduce_scatter_time,
)

__all__ = [
    "EncoderMBCost",
    "LLMOpCost",
    "Layout",
    "dp_sync_time",
    "encoder_mb_cost",
    "encoder_params",
    "layers_per_virtual_stage",
    "llm_op_costs",
    "llm_stage_params",
    "static_memory",
]

EncoderConfig = VisionEncoderConfig | AudioEncoderConfig
BF16 = 2
ACT_BYTES_PER_HIDDEN = 34
"""Korthikanti et al. 2022: bytes per token per hidden unit per layer kept for backward (bf16,
dropout masks included), with TP+SP and attention scores not stored."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel configuration of the job (the tuner's search space)."""

    tp: int = 1
    """LLM tensor parallel (with sequence parallel); also the encoders' LSSP group per stage."""
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    """Packed sequences per micro-batch."""
    recompute: Literal["selective", "full"] = "selective"
    """LLM activations: ``selective`` keeps 34 sbh/t per layer (attention recomputed by
    FlashAttention's backward); ``full`` keeps only layer inputs and reruns the forward."""
    encoder_recompute: Literal["selective", "full"] = "selective"
    llm_zero: Literal[0, 1] = 1
    """1: Megatron's distributed optimizer (optimizer state sharded over dp)."""
    encoder_zero: Literal[0, 2, 3] = 2
    """Encoder gradients/optimizer (2) and parameters too (3) sharded over every replica."""
    eta: int = 4096
    """LSSP: encoder samples longer than this run sequence parallel over the stage's tp ranks."""
    reorder_group: int = 1
    """Data-parallel ranks per reorder group (1: no reordering)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "dp", "micro_batch_size", "reorder_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp % self.reorder_group:
            raise ValueError(f"reorder_group {self.reorder_group} must divide dp {self.dp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        """``tp4 pp2 dp8 vpp1 eta4096 g8 sel``: one line for tables."""
        return (
            f"tp{self.tp} pp{self.pp} vpp{self.vpp} dp{self.dp} eta{self.eta} "
            f"g{self.reorder_group} {'full-AC' if self.recompute == 'full' else 'sel-AC'}"
        )


def layers_per_virtual_stage(num_layers: int, pp: int, vpp: int) -> list[int]:
    """Layers of each virtual stage ``v = chunk * pp + stage`` (remainder to the first ones)."""
    n = pp * vpp
    if num_layers < n:
        raise ValueError(f"{num_layers} layers cannot fill {pp} x {vpp} virtual stages")
    base, extra = divmod(num_layers, n)
    return [base + (v < extra) for v in range(n)]


def _layer_matmul_params(llm: LLMConfig) -> int:
    return transformer_matmul_params(
        num_layers=1,
        hidden_size=llm.hidden_size,
        ffn_hidden_size=llm.ffn_hidden_size,
        num_heads=llm.num_attention_heads,
        num_query_groups=llm.num_query_groups,
        gated_mlp=bool(llm.gated_mlp),
    )


@dataclass(frozen=True)
class LLMOpCost:
    """One micro-batch on one virtual stage."""

    forward: float
    """Seconds of F (compute + exposed TP communication)."""
    backward: float
    """Seconds of B (2x compute, +1x with full recompute, + TP communication)."""
    activation_bytes: float
    """Per rank, kept from F until B."""
    send_bytes: float
    """Per rank, the activation sent to the next stage (sequence-parallel shard)."""


def llm_op_costs(
    llm: LLMConfig,
    micro_batch: Sequence[PackedSequence],
    layout: Layout,
    device: DeviceProfile,
    *,
    tp_overlap: float = 0.0,
) -> list[LLMOpCost]:
    """Costs of one micro-batch on every virtual stage (index ``chunk * pp + stage``).

    FLOPs per layer: ``2 x matmul params x tokens`` (GEMM) plus ``4 x heads x head_dim x sum s^2``
    (attention, full square as the MFU convention counts it; FlashAttention skips the masked
    half, which the attention efficiency absorbs). The LM head (``h x vocab``) runs on the last
    virtual stage. TP+SP moves four ``tokens x h`` bf16 tensors per layer and direction (two
    all-gathers, two reduce-scatters); ``tp_overlap`` hides that fraction of it behind GEMMs.
    """
    tp = layout.tp
    seg = [g.length for s in micro_batch for g in s.segments]
    tokens = sum(seg)
    h = llm.hidden_size
    width = h / math.sqrt(tp)
    gemm = 2.0 * _layer_matmul_params(llm) * tokens / tp
    attn = attention_flops(
        num_layers=1, num_heads=llm.num_attention_heads, head_dim=llm.head_dim, seq_lengths=seg
    )
    attn /= tp
    layer_f = device.compute_time(gemm, "gemm", width=width) + device.compute_time(
        attn, "attention"
    )
    link = device.link(tp)
    comm = 2 * (
        all_gather_time(tokens * h * BF16, tp, link)
        + reduce_scatter_time(tokens * h * BF16, tp, link)
    )
    comm *= 1.0 - tp_overlap
    head_f = device.compute_time(2.0 * h * llm.vocab_size * tokens / tp, "gemm", width=width)
    per_layer_act = (
        ACT_BYTES_PER_HIDDEN * tokens * h / tp
        if layout.recompute == "selective"
        else BF16 * tokens * h / tp
    )
    redo = 1.0 if layout.recompute == "full" else 0.0
    layers = layers_per_virtual_stage(llm.num_layers, layout.pp, layout.vpp)
    out = []
    for v, n in enumerate(layers):
        f = n * (layer_f + comm)
        b = n * ((2.0 + redo) * layer_f + (1.0 + redo) * comm)
        act = n * per_layer_act
        if v == len(layers) - 1:
            f += head_f
            b += 2.0 * head_f
            act += 4.0 * tokens * llm.vocab_size / tp  # fp32 logits for the loss backward
        out.append(LLMOpCost(f, b, act, BF16 * tokens * h / tp))
    return out


def _encoder_split(enc: EncoderConfig, lengths: Sequence[int]) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one encoder forward over independent samples."""
    attn = attention_flops(
        num_layers=enc.num_layers,
        num_heads=enc.num_heads,
        head_dim=enc.hidden_size // enc.num_heads,
        seq_lengths=lengths,
    )
    return enc.flops(lengths) - attn, attn


@dataclass(frozen=True)
class EncoderMBCost:
    """One encoder micro-batch (one modality's media of one LLM micro-batch) on one stage."""

    forward: float
    """Seconds: the busiest LSSP rank's compute + Ulysses all-to-all of the long samples."""
    backward: float
    activation_bytes: float
    """Kept from forward to backward on the busiest rank."""
    output_bytes: float
    """Per rank, projected outputs sent to stage 0 (``tokens x llm_hidden`` bf16 / group)."""
    sequence_parallel: int
    """Samples above eta (sequence parallel)."""


def encoder_mb_cost(
    enc: EncoderConfig,
    lengths: Sequence[int],
    *,
    llm_hidden: int,
    layout: Layout,
    device: DeviceProfile,
) -> EncoderMBCost:
    """Time and memory of one encoder micro-batch under LSSP on a stage's ``tp`` ranks.

    The plan is :func:`~omni_trainer.multiplex.lssp.plan_lssp` itself, with each sample's cost in
    seconds: short samples are placed LPT on single ranks, long ones split evenly; the busiest
    rank sets the time. Ulysses moves q, k, v in and the output back (four ``shard x h`` bf16
    all-to-alls per layer and direction). The projector (``enc_h -> llm_h -> llm_h``) is counted
    as encoder GEMM work.
    """
    g = layout.tp
    he = enc.hidden_size

    def seconds(n: int) -> float:
        gemm, attn = _encoder_split(enc, [n])
        gemm += 2.0 * n * llm_hidden * (he + llm_hidden)
        return device.compute_time(gemm, "gemm", width=he) + device.compute_time(attn, "attention")

    plan = plan_lssp(lengths, eta=layout.eta, group_size=g, cost=seconds)
    busiest = max(range(g), key=lambda r: plan.rank_cost[r])
    compute = plan.rank_cost[busiest]
    link = device.link(g)
    a2a = sum(
        enc.num_layers * 4 * all_to_all_time(lengths[i] / g * he * BF16, g, link) for i in plan.long
    )
    tokens_on = sum(lengths[i] for i in plan.short[busiest]) + sum(
        lengths[i] / g for i in plan.long
    )
    per_token = (
        ACT_BYTES_PER_HIDDEN * he * enc.num_layers
        if layout.encoder_recompute == "selective"
        else BF16 * he * enc.num_layers
    )
    redo = 1.0 if layout.encoder_recompute == "full" else 0.0
    return EncoderMBCost(
        forward=compute + a2a,
        backward=(2.0 + redo) * compute + (1.0 + redo) * a2a,
        activation_bytes=tokens_on * per_token,
        output_bytes=sum(lengths) * llm_hidden * BF16 / g,
        sequence_parallel=len(plan.long),
    )


def llm_stage_params(llm: LLMConfig, layout: Layout, stage: int) -> float:
    """LLM parameters held by one rank of ``stage`` (its chunks' layers / tp, embedding on stage
    0, LM head on the last stage)."""
    layers = layers_per_virtual_stage(llm.num_layers, layout.pp, layout.vpp)
    mine = sum(layers[c * layout.pp + stage] for c in range(layout.vpp))
    p = mine * _layer_matmul_params(llm) / layout.tp
    if stage == 0:
        p += llm.vocab_size * llm.hidden_size / layout.tp
    if stage == layout.pp - 1:
        p += llm.vocab_size * llm.hidden_size / layout.tp
    return p


def encoder_params(model: ModelConfig) -> float:
    """Parameters of every encoder plus its projector (each stage holds them all)."""
    total = 0.0
    for modality in ("image", "audio"):
        enc = getattr(model.encoders, modality)
        if enc is not None:
            h = model.llm.hidden_size
            total += enc.params() + enc.hidden_size * h + h * h
    return total


def static_memory(model: ModelConfig, layout: Layout, stage: int) -> dict[str, float]:
    """Bytes per rank that do not change during the step, by kind.

    LLM: bf16 weights (2), fp32 main grads (4), fp32 master + Adam m, v (12, divided by dp with
    ZeRO-1). Encoders: replicated on every rank; ZeRO-2 divides grads + optimizer state (16 bytes)
    and ZeRO-3 also the weights over all ``world_size`` replicas.
    """
    p = llm_stage_params(model.llm, layout, stage)
    shard = layout.dp if layout.llm_zero else 1
    pe = encoder_params(model)
    n = layout.world_size
    z = layout.encoder_zero
    return {
        "llm_weights": 2.0 * p,
        "llm_grads": 4.0 * p,
        "llm_optimizer": 12.0 * p / shard,
        "encoder_weights": 2.0 * pe / (n if z == 3 else 1),
        "encoder_grads_optimizer": 16.0 * pe / (n if z >= 2 else 1),
    }


def dp_sync_time(model: ModelConfig, layout: Layout, stage: int, device: DeviceProfile) -> float:
    """Gradient sync of one stage after its last backward, not overlapped (a pessimistic bound):
    LLM grads reduce-scattered and weights all-gathered over dp (distributed optimizer);
    encoder grads reduce-scattered over all replicas (ZeRO-2) and all-gathered back. Either pair
    costs one all-reduce of ``device.grad_bytes`` per element (bf16 on GPUs, fp32 on a CPU)."""
    link = device.link(layout.world_size)  # dp groups span nodes unless the job fits one
    b = device.grad_bytes
    p = llm_stage_params(model.llm, layout, stage)
    t = reduce_scatter_time(b * p, layout.dp, link) + all_gather_time(b * p, layout.dp, link)
    pe = encoder_params(model)
    t += reduce_scatter_time(b * pe, layout.world_size, link)
    t += all_gather_time(b * pe, layout.world_size, link)
    return t


def p2p_seconds(nbytes: float, device: DeviceProfile, *, crosses_nodes: bool = True) -> float:
    """A pipeline send (activations, encoder outputs, gradients)."""
    return p2p_time(nbytes, device.inter if crosses_nodes else device.intra)
