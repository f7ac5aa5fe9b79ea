"""What a run reports: per step (:class:`StepResult`) and for the run (:class:`RunSummary`,
``--summary``), every figure measured; the global work and sample fingerprint of a step.

MFU is ``costs.flops.mfu`` everywhere (steps, Prometheus, the summary, the planner), over
model FLOPs counted as ``costs.flops.MFU_CONVENTION`` says (the summary names it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_trainer.components.metrics import TRAINER_PHASES as PHASES
from omni_trainer.costs.flops import MFU_CONVENTION, mfu
from omni_trainer.costs.model_flops import StepFlops
from omni_trainer.data.packing import PackedSequence
from omni_trainer.distributed import comm
from omni_trainer.mcore.parallel import ProcessGroups

_FINGERPRINT_MOD = 1 << 40  # a sum over up to 2**23 ranks still fits an int64


def _id_hash(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "little")


def samples_per_modality(batch: list[PackedSequence]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in batch:
        for seg, sample in zip(seq.segments, seq.samples, strict=True):
            if sample.chunk <= 0:  # a long text's later chunks are the same sample
                counts[seg.modality] = counts.get(seg.modality, 0) + 1
    return counts


def global_work(
    flops: StepFlops, local: list[PackedSequence], *, group: object
) -> tuple[int, float, str]:
    """Tokens, training FLOPs and sample fingerprint of the whole global batch (each replica
    saw its share, ``group`` is the data-parallel one). The fingerprint is order-free, so it
    names the set of samples a step consumed whatever rank consumed them: equal fingerprints,
    equal data."""
    ids = [s.sample_id for seq in local for s in seq.samples]
    work = torch.tensor([float(flops.tokens), flops.training], dtype=torch.float64)
    digest = torch.tensor([sum(_id_hash(i) for i in ids) % _FINGERPRINT_MOD], dtype=torch.int64)
    comm.all_reduce(work, group=group)
    comm.all_reduce(digest, group=group)
    fingerprint = int(digest.item()) % _FINGERPRINT_MOD
    return int(work[0].item()), float(work[1].item()), f"{fingerprint:010x}"


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int
    flops: float
    phases: dict[str, float]  # PHASES, seconds
    fingerprint: str  # of the set of samples the global batch consumed
    samples: dict[str, int]  # per modality, this replica's share of the step
    encoder_activation_peak_bytes: int
    activation_peak_bytes: int  # LLM schedule + encoders: saved for the backward, at peak
    media_bytes_read: int  # media arrays this rank loaded during the step (the ones it encodes)
    op_log: list[tuple[str, float, float]] = field(default_factory=list)
    """With ``OMNI_OP_LOG=1`` (CPU): every span and LLM forward as (name, start, end) seconds
    from the step's start, for the replay simulator; else empty."""


@dataclass
class RunSummary:
    """What ``--summary`` writes; every field is measured in this run."""

    steps: int
    first_step: int
    """0, or the checkpoint step a resumed run continued from."""
    initial_loss: float
    final_loss: float
    loss_curve: list[float]
    batch_fingerprints: list[str]
    """Per step, an order-free fingerprint of the samples consumed (equal: same data)."""
    grad_norm_curve: list[float]
    lr_curve: list[float]
    tokens_per_second: float
    mfu: float
    tokens_per_second_curve: list[float]
    mfu_curve: list[float]
    peak_flops: float
    peak_flops_source: str
    mfu_convention: str
    """How model FLOPs are counted: ``costs.flops.MFU_CONVENTION``."""
    samples_per_modality: dict[str, int]
    tokens_per_modality: dict[str, int]
    world_size: int
    layout: dict[str, object]
    seed: int
    wall_time_s: float
    mean_step_time_s: float
    step_time_curve: list[float] = field(default_factory=list)
    """Seconds of every step, the first (warm-up) included."""
    parameters: dict[str, int] = field(default_factory=dict)
    data_reorder: dict[str, object] = field(default_factory=dict)
    """Reordering of sequences between data-parallel ranks: group size, method, traffic."""
    breakdown: list[dict[str, object]] = field(default_factory=list)
    """Per rank: mean seconds per step in each phase, and the peak encoder activation bytes."""
    memory: dict[str, int] = field(default_factory=dict)
    """The busiest rank's ``rank``, ``params_bytes`` (model weights + fp32 main copies),
    ``grads_bytes``, ``optimizer_state_bytes`` and ``activation_peak_bytes`` (the most bytes
    saved for the backward at once, LLM plus encoders: ``components.memory``)."""
    skipped_samples: dict[str, int] = field(default_factory=dict)
    """Samples the loaders skipped, by reason (missing, corrupt, too_long...), all replicas."""


def _global_counters(data, group) -> dict[str, dict[str, int]]:
    """Samples and tokens per modality over all data-parallel replicas."""
    everyone = comm.all_gather_object(data.counters, group=group)
    total: dict[str, dict[str, int]] = {}
    for counters in everyone:
        for key in ("samples_per_modality", "tokens_per_modality", "skipped_samples"):
            bucket = total.setdefault(key, {})
            for m, v in counters.get(key, {}).items():
                bucket[m] = bucket.get(m, 0) + v
    return total


def _llm_parameter_count(model, groups: ProcessGroups) -> int:
    """Each LLM weight once over TP shards and stages (frozen ones too)."""
    mine = sum(
        p.numel()
        for p in model.llm_parameters()
        if (getattr(p, "tensor_model_parallel", False) or groups.tp_rank == 0)
        and not getattr(p, "shared", False)  # a tied embedding's 2nd copy
    )
    total = torch.tensor([float(mine)], dtype=torch.float64)
    comm.all_reduce(total, group=groups.model_parallel)
    return int(total.item())


def summarize(
    results: list[StepResult],
    *,
    wall: float,
    cfg,
    groups: ProcessGroups,
    parts,
    optimizer: torch.optim.Optimizer,
    data,
    peak: tuple[float, str],
    first_step: int,
    reorder_bytes: list[int],
) -> RunSummary:
    """The run's summary (a collective: every rank calls it; all get the same one)."""
    peak_flops, peak_source = peak
    timed = results[1:] if len(results) > 1 else results  # step 1 pays one-off warmup
    seconds = sum(r.seconds for r in timed)
    dims = groups.dims
    counters = _global_counters(data, groups.dp)
    mine = _rank_row(results, timed, groups=groups, memory=parts.memory(optimizer))
    llm_params = _llm_parameter_count(parts.model, groups)
    breakdown = comm.all_gather_object(mine)
    busiest = max(breakdown, key=lambda row: sum(row["memory"].values()))
    return RunSummary(
        steps=len(results),
        first_step=first_step,
        initial_loss=results[0].loss,
        final_loss=results[-1].loss,
        loss_curve=[r.loss for r in results],
        batch_fingerprints=[r.fingerprint for r in results],
        grad_norm_curve=[r.grad_norm for r in results],
        lr_curve=[r.lr for r in results],
        tokens_per_second=sum(r.tokens for r in timed) / seconds,
        mfu=mfu(sum(r.flops for r in timed) / seconds, peak_flops),
        tokens_per_second_curve=[r.tokens / r.seconds for r in results],
        mfu_curve=[mfu(r.flops / r.seconds, peak_flops) for r in results],
        peak_flops=peak_flops,
        peak_flops_source=peak_source,
        mfu_convention=MFU_CONVENTION,
        samples_per_modality=dict(sorted(counters["samples_per_modality"].items())),
        tokens_per_modality=dict(sorted(counters["tokens_per_modality"].items())),
        world_size=dims.world_size,
        layout={
            **dims.as_dict(),
            "name": dims.describe(),
            "encoder_policy": cfg.parallelism.encoder.policy,
            "encoder_eta": cfg.parallelism.encoder.eta,
        },
        seed=cfg.seed,
        wall_time_s=wall,
        mean_step_time_s=seconds / len(timed),
        step_time_curve=[r.seconds for r in results],
        parameters={
            "llm": llm_params,
            "encoders": sum(p.numel() for p in parts.model.encoder_parameters()),
        },
        breakdown=breakdown,
        memory={"rank": busiest["rank"], **busiest["memory"]},
        skipped_samples=dict(sorted(counters["skipped_samples"].items())),
        data_reorder=_data_reorder(cfg, dp=dims.dp, reorder_bytes=reorder_bytes),
    )


def _rank_row(
    results: list[StepResult],
    timed: list[StepResult],
    *,
    groups: ProcessGroups,
    memory: dict[str, int],
) -> dict[str, Any]:
    """This rank's row of the breakdown: where it stands, its mean seconds per phase over the
    timed steps, its encoder and media figures, its memory (with the activation peak)."""
    memory["activation_peak_bytes"] = max(r.activation_peak_bytes for r in results)
    mine = {
        "rank": groups.rank,
        "stage": groups.anchor.stage,
        "tp_rank": groups.tp_rank,
        "dp_rank": groups.dp_rank,
        **{
            f"{phase}_s": sum(r.phases.get(phase, 0.0) for r in timed) / len(timed)
            for phase in PHASES
        },
        "encoder_activation_peak_bytes": max(r.encoder_activation_peak_bytes for r in results),
        "media_bytes_read": sum(r.media_bytes_read for r in results),
        "memory": memory,
    }
    if any(r.op_log for r in timed):
        mine["op_log"] = [r.op_log for r in timed]
    return mine


def _data_reorder(cfg, *, dp: int, reorder_bytes: list[int]) -> dict[str, Any]:
    """The reordering the run used and the bytes it moved per step on average."""
    return {
        "group_size": cfg.data.reorder.group_size,
        "method": cfg.data.reorder.method,
        "loader_shards": cfg.data.shards_for(dp),
        "bytes_moved_per_step": (sum(reorder_bytes) / len(reorder_bytes) if reorder_bytes else 0),
    }
