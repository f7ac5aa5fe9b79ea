"""Per-op times and per-rank memory of a multimodal job on a device profile.

Compute time is FLOPs over ``peak x efficiency`` (``devices.EfficiencyTable``), with the FLOPs of
the trainer's own accounting (``costs/flops``, the encoder configs' ``flops()``), split into
GEMM and attention parts because they run at different efficiencies. Communication is the
alpha-beta model of ``devices``. Memory follows Megatron's bookkeeping: bf16 parameters, fp32
main gradients, fp32 master weights + Adam moments (sharded over data parallel with the
distributed optimizer, ZeRO-1), activations per Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2: ``34 s b h / t`` bytes per layer with tensor
and sequence parallelism once attention scores are not stored, which FlashAttention guarantees;
``2 s b h / t`` with full recomputation). A third choice offloads the selective activations to
host memory and brings them back for the backward, over ``DeviceProfile.host``.

Pure Python: the planner runs without torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from omni_trainer.balance.lssp import plan_lssp
from omni_trainer.costs.activation_bytes import BF16, kept_bytes_per_token
from omni_trainer.costs.devices import (
    DeviceProfile,
    all_gather_time,
    all_to_all_time,
    reduce_scatter_time,
)
from omni_trainer.costs.flops import attention_flops, transformer_matmul_params
from omni_trainer.data.packing import PackedSequence
from omni_trainer.models.config import LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig

__all__ = [
    "AC_NAMES",
    "OFFLOAD_RESIDENT_LAYERS",
    "EncoderMBCost",
    "LLMOpCost",
    "Layout",
    "dp_bucket_params",
    "dp_sync_time",
    "encoder_mb_cost",
    "encoder_params",
    "exposed_bucketed_sync",
    "layers_per_virtual_stage",
    "llm_activation_bytes",
    "llm_op_costs",
    "llm_stage_params",
    "static_memory",
]

EncoderConfig = VisionEncoderConfig | AudioEncoderConfig
OFFLOAD_RESIDENT_LAYERS = 2
"""Activation offload keeps two layers of one micro-batch on the device while a virtual stage
runs it: the layer being computed and the one whose copy (to the host in F, back in B) is in
flight (double buffering); everything else of the micro-batch lives in host memory."""
Recompute = Literal["selective", "full", "offload"]


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
    recompute: Recompute = "selective"
    """LLM activations: ``selective`` keeps 34 sbh/t per layer (attention recomputed by
    FlashAttention's backward); ``full`` keeps only layer inputs and reruns the forward;
    ``offload`` copies the selective activations to host memory after each layer's forward and
    back before its backward (``OFFLOAD_RESIDENT_LAYERS`` stay on the device)."""
    encoder_recompute: Literal["selective", "full"] = "selective"
    """The encoders follow ``train.recompute`` (``full``: only each block's input is kept)."""
    llm_zero: Literal[0, 1] = 1
    """1: the distributed optimizer, ZeRO-1 (``parallelism.distributedOptimizer``: fp32 main
    weights and Adam moments sharded over dp)."""
    sequence_parallel: bool = True
    """``parallelism.sequenceParallel`` with tp > 1: norms, dropouts and residuals sharded
    along the sequence; off, each TP rank keeps them whole."""
    encoder_zero: Literal[0, 2, 3] = 2
    """Encoder gradients/optimizer (2) and parameters too (3) sharded over every replica."""
    eta: int = 4096
    """LSSP: encoder samples longer than this run sequence parallel over the stage's tp ranks."""
    reorder_group: int = 1
    """Data-parallel ranks per reorder group (1: no reordering)."""
    overlap_grad_reduce: bool = False
    """``parallelism.overlapGradReduce`` (megatron DDP's ``overlap_grad_reduce``; the trainer's
    default with ZeRO-1): the LLM gradient reduce-scatter runs bucket by bucket during the last
    micro-batch's backward (:func:`exposed_bucketed_sync`); False prices the whole sync after
    the backward."""

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
        """``tp4 pp2 vpp1 dp8 eta4096 g8 sel-AC``: one line for tables."""
        return (
            f"tp{self.tp} pp{self.pp} vpp{self.vpp} dp{self.dp} eta{self.eta} "
            f"g{self.reorder_group} {AC_NAMES[self.recompute]}"
        )


AC_NAMES: dict[str, str] = {"selective": "sel-AC", "full": "full-AC", "offload": "offload-AC"}
"""How tables name the LLM activation choices."""


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
    working_bytes: float = 0.0
    """Per rank, held only while F runs and again while B runs (offload's resident layers)."""


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
    (attention, half of each causal square as the MFU convention counts it and FlashAttention
    computes it). The LM head (``h x vocab``) runs on the last
    virtual stage. TP+SP moves four ``tokens x h`` bf16 tensors per layer and direction (two
    all-gathers, two reduce-scatters); ``tp_overlap`` hides that fraction of it behind GEMMs.

    Activation offload moves each layer's ``34 s h / t`` bytes to the host in F and back in B
    over ``device.host``; a layer's copy overlaps the compute of its neighbour, so per layer
    only ``max(0, copy - layer time)`` is exposed (F: ``copy - F_layer``; B: ``copy -
    B_layer``). Nothing of the micro-batch stays on the device between F and B except the last
    stage's logits; ``min(n, OFFLOAD_RESIDENT_LAYERS)`` layers are resident while F or B runs.

    Raises:
        ValueError: offload on a device without a host link.
    """
    tp = layout.tp
    seg = [g.length for s in micro_batch for g in s.segments]
    tokens = sum(seg)
    h = llm.hidden_size
    width = h / math.sqrt(tp)
    gemm = 2.0 * _layer_matmul_params(llm) * tokens / tp
    attn = attention_flops(
        num_layers=1,
        num_heads=llm.num_attention_heads,
        head_dim=llm.head_dim,
        seq_lengths=seg,
        causal=True,
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
    redo = 1.0 if layout.recompute == "full" else 0.0
    layer_fwd = layer_f + comm
    layer_bwd = (2.0 + redo) * layer_f + (1.0 + redo) * comm
    exposed_f = exposed_b = 0.0
    if layout.recompute == "offload":
        if device.host is None:
            raise ValueError(f"{device.name} has no host link to offload activations over")
        copy = device.host.time(
            kept_bytes_per_token(h, 1, tp=tp, sequence_parallel=layout.sequence_parallel) * tokens
        )
        exposed_f = max(0.0, copy - layer_fwd)
        exposed_b = max(0.0, copy - layer_bwd)
    layers = layers_per_virtual_stage(llm.num_layers, layout.pp, layout.vpp)
    memory = llm_activation_bytes(llm, tokens, layout)
    out = []
    for v, (n, (act, working)) in enumerate(zip(layers, memory, strict=True)):
        f = n * (layer_fwd + exposed_f)
        b = n * (layer_bwd + exposed_b)
        if v == len(layers) - 1:
            f += head_f
            b += 2.0 * head_f
        out.append(LLMOpCost(f, b, act, layer_input_bytes(llm, tokens, layout), working))
    return out


def layer_input_bytes(llm: LLMConfig, tokens: float, layout: Layout) -> float:
    """The bf16 hidden states of ``tokens`` one rank sends or keeps at a layer boundary (sharded
    along the sequence with sequence parallelism, whole on every TP rank without it)."""
    return (
        kept_bytes_per_token(
            llm.hidden_size,
            1,
            tp=layout.tp,
            sequence_parallel=layout.sequence_parallel,
            full_recompute=True,
        )
        * tokens
    )


def llm_activation_bytes(
    llm: LLMConfig, tokens: float, layout: Layout
) -> list[tuple[float, float]]:
    """Per virtual stage, the bytes per rank one micro-batch of ``tokens`` keeps from F to B and
    those resident only while F or B runs (offload's layers in flight); see :func:`llm_op_costs`."""
    h, tp, sp = llm.hidden_size, layout.tp, layout.sequence_parallel
    full = layout.recompute == "full"
    selective_act = kept_bytes_per_token(h, 1, tp=tp, sequence_parallel=sp) * tokens
    per_layer_act = kept_bytes_per_token(h, 1, tp=tp, sequence_parallel=sp, full_recompute=full)
    per_layer_act *= tokens
    layers = layers_per_virtual_stage(llm.num_layers, layout.pp, layout.vpp)
    out = []
    for v, n in enumerate(layers):
        if layout.recompute == "offload":
            act, working = 0.0, min(n, OFFLOAD_RESIDENT_LAYERS) * selective_act
        else:
            act, working = n * per_layer_act, 0.0
        if v == len(layers) - 1:
            act += 4.0 * tokens * llm.vocab_size / tp  # fp32 logits for the loss backward
        out.append((act, working))
    return out


def _encoder_split(enc: EncoderConfig, lengths: Sequence[int]) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one encoder forward over independent samples (of
    these output token counts; the blocks see ``merge_unit`` times as many)."""
    attn = attention_flops(
        num_layers=enc.num_layers,
        num_heads=enc.num_heads,
        head_dim=enc.hidden_size // enc.num_heads,
        seq_lengths=[n * enc.merge_unit for n in lengths],
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
    """Per stage-0 rank, projected outputs it receives: with sequence parallelism its sequence
    shard (``tokens x llm_hidden`` bf16 / tp, send-then-reshard), without it every token (each
    TP rank of stage 0 takes whole pieces)."""
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

    The plan is :func:`~omni_trainer.balance.lssp.plan_lssp` itself, with each sample's cost in
    seconds: short samples are placed LPT on single ranks, long ones split evenly; the busiest
    rank sets the time. Ulysses moves q, k, v in and the output back (four ``shard x h`` bf16
    all-to-alls per layer and direction). The projector (``enc_h -> llm_h -> llm_h``) is counted
    as encoder GEMM work.
    """
    g = layout.tp
    he, unit = enc.hidden_size, enc.merge_unit  # unit: block tokens per output token

    def seconds(n: int) -> float:
        gemm, attn = _encoder_split(enc, [n])
        gemm += 2.0 * n * llm_hidden * (enc.output_size + llm_hidden)
        return device.compute_time(gemm, "gemm", width=he) + device.compute_time(attn, "attention")

    plan = plan_lssp(lengths, eta=layout.eta, group_size=g, cost=seconds)
    busiest = max(range(g), key=lambda r: plan.rank_cost[r])
    compute = plan.rank_cost[busiest]
    link = device.link(g)
    a2a = sum(
        enc.num_layers * 4 * all_to_all_time(lengths[i] * unit / g * he * BF16, g, link)
        for i in plan.long
    )
    tokens_on = unit * (
        sum(lengths[i] for i in plan.short[busiest]) + sum(lengths[i] / g for i in plan.long)
    )
    per_token = kept_bytes_per_token(
        he, enc.num_layers, full_recompute=layout.encoder_recompute == "full"
    )
    redo = 1.0 if layout.encoder_recompute == "full" else 0.0
    return EncoderMBCost(
        forward=compute + a2a,
        backward=(2.0 + redo) * compute + (1.0 + redo) * a2a,
        activation_bytes=tokens_on * per_token,
        output_bytes=sum(lengths) * llm_hidden * BF16 / (g if layout.sequence_parallel else 1),
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
            total += enc.params() + enc.output_size * h + h * h
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


def dp_bucket_params(dp: int) -> int:
    """Parameters per gradient bucket: megatron-core's default ``max(40M, 1M x dp)``
    (``DistributedDataParallelConfig.bucket_size``: larger dp needs larger buckets so the
    collectives stay bandwidth-bound)."""
    return max(40_000_000, 1_000_000 * dp)


def exposed_bucketed_sync(params: float, bucket: float, sync: float, backward: float) -> float:
    """Seconds of a gradient sync still running after the backward it overlaps, bucket by bucket.

    The backward produces gradients at a steady rate (bucket ``i`` is ready once its share of
    ``params`` is done, the last one at the backward's end); buckets sync one at a time, in
    order, each taking its share of ``sync`` (per-bucket latency ignored, so the result never
    exceeds ``sync``). That is ``sync`` with one bucket or no backward, the last bucket's share
    when the link keeps up with the backward, and ``sync - backward (k-1)/k`` for ``k`` equal
    buckets when it does not.

    Args:
        params: gradient elements to sync.
        bucket: elements per bucket (the last one takes the remainder).
        sync: seconds of the unoverlapped sync of all of them.
        backward: seconds of the backward that produces them.
    """
    if params <= 0 or sync <= 0:
        return 0.0
    finish = filled = 0.0
    while filled < params:
        size = min(bucket, params - filled)
        filled += size
        finish = max(finish, backward * filled / params) + sync * size / params
    return min(sync, max(0.0, finish - backward))  # min: float rounding of the shares


def dp_sync_time(
    model: ModelConfig,
    layout: Layout,
    stage: int,
    device: DeviceProfile,
    *,
    backward: float = 0.0,
) -> float:
    """Exposed gradient sync of one stage after its last backward.

    LLM grads reduce-scattered and weights all-gathered over dp (distributed optimizer; without
    it one all-reduce of the grads, the same cost); encoder grads reduce-scattered over all
    replicas (ZeRO-2) and all-gathered back. Either pair costs one all-reduce of
    ``device.grad_bytes`` per element (bf16 on GPUs, fp32 on a CPU).

    With ``layout.overlap_grad_reduce`` the LLM gradient collective runs in buckets of
    :func:`dp_bucket_params` during ``backward`` (the stage's last micro-batch, when the grads
    are final) and only what :func:`exposed_bucketed_sync` leaves is counted; the weight
    all-gather (after the optimizer step) and the encoders' sync stay exposed. Without it (or
    with ``backward`` 0) the whole sync is counted: the pessimistic bound.
    """
    link = device.link(layout.world_size)  # dp groups span nodes unless the job fits one
    b = device.grad_bytes
    p = llm_stage_params(model.llm, layout, stage)
    grads = reduce_scatter_time(b * p, layout.dp, link)
    weights = all_gather_time(b * p, layout.dp, link)
    if not layout.llm_zero:  # all-reduce of the grads, nothing to gather afterwards
        grads, weights = grads + weights, 0.0
    if layout.overlap_grad_reduce:
        grads = exposed_bucketed_sync(p, dp_bucket_params(layout.dp), grads, backward)
    t = grads + weights
    pe = encoder_params(model)
    t += reduce_scatter_time(b * pe, layout.world_size, link)
    t += all_gather_time(b * pe, layout.world_size, link)
    return t
