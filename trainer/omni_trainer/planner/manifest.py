"""What ``omni plan --tune`` reads from the manifest: the GPU it runs on, and its own layout
(scored beside the tuner's best, so the gain of switching is visible)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from omni_trainer.config import TrainerConfig, format_errors
from omni_trainer.costs.devices import PROFILES, DeviceProfile
from omni_trainer.costs.step_costs import Layout, Recompute
from omni_trainer.distributed.layout import layout_problems
from omni_trainer.models.encoders.config import DEFER_HF

DEFAULT_DEVICE = "H100"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label NVIDIA's GPU feature discovery sets (e.g. ``NVIDIA-H100-80GB-HBM3``)."""
TIE = 1e-3
"""Predicted tokens/s closer than this (relative) rank equal."""


def device_for(
    explicit: str | None, cluster: Mapping[str, Any] | None
) -> tuple[DeviceProfile, str]:
    """The device profile to predict on and where the choice comes from: ``--device``, else the
    GPU product the manifest's ``spec.scheduling.nodeSelector`` asks for, else H100."""
    if explicit is not None:
        key = explicit.upper()
        if key not in PROFILES:
            raise ValueError(f"--device must be one of {', '.join(PROFILES)}, not {explicit!r}")
        return PROFILES[key], "--device"
    selector = ((cluster or {}).get("scheduling") or {}).get("nodeSelector") or {}
    product = str(selector.get(GPU_PRODUCT_LABEL, ""))
    # the longest name first: GH200 before H200, H200 before H100's prefix-free match
    for key in sorted(PROFILES, key=len, reverse=True):
        if key in product.upper():
            return PROFILES[key], f"spec.scheduling.nodeSelector {GPU_PRODUCT_LABEL}={product}"
    return PROFILES[DEFAULT_DEVICE], "default; the manifest names no GPU product"


def own_layout(cfg: TrainerConfig, gpus: int) -> tuple[Layout | None, str]:
    """The manifest's own parallel configuration on ``gpus`` GPUs, or None and why not."""
    par = cfg.parallelism
    if par.context > 1:
        return None, f"context {par.context}: the planner does not model context parallelism"
    model = par.tensor * par.pipeline
    if gpus % model:
        return None, f"tensor x pipeline ({model}) does not divide {gpus} GPUs"
    dp = gpus // model
    problems = layout_problems(cfg, gpus)  # what ``omni train`` would refuse at this size
    if problems:
        path, message = problems[0]
        return None, f"spec.trainer.{path}: {message}"
    group = cfg.data.reorder.group_size
    if dp % group:
        return None, f"reorder groupSize {group} does not divide data parallel {dp}"
    layout = Layout(
        tp=par.tensor,
        pp=par.pipeline,
        vpp=par.virtual_pipeline,
        dp=dp,
        micro_batch_size=cfg.data.micro_batch_size,
        recompute=PLANNED_RECOMPUTE[cfg.train.recompute],
        encoder_recompute="full" if cfg.train.recompute == "full" else "selective",
        llm_zero=1 if par.distributed_optimizer_on(dp) else 0,
        overlap_grad_reduce=par.overlap_grad_reduce_on(dp),
        sequence_parallel=par.sequence_parallel_on,
        encoder_zero=par.encoder_zero(dp),
        eta=par.encoder.eta,
        reorder_group=group,
    )
    return layout, "the manifest's"


PLANNED_RECOMPUTE: dict[str, Recompute] = {
    "none": "selective",
    "selective": "selective",
    "full": "full",
}
"""``train.recompute`` as the planner prices it: on GPUs the attention kernels (TE, flash) keep
no attention scores, so recomputing core attention (selective) frees what ``none`` holds only
on the CPU path; both cost the 34 sbh/t of Korthikanti's selective row."""


def manifest_fields(layout: Layout, *, policy: str) -> dict[str, dict[str, Any]]:
    """The manifest fields (camelCase, by section of ``spec.trainer``) that run ``layout``:
    what ``omni plan --tune`` proposes is what ``omni train`` is given.

    Raises:
        ValueError: a choice the trainer cannot run (activation offload, encoder ZeRO-3).
    """
    if layout.recompute not in ("selective", "full"):
        raise ValueError(f"the trainer has no {layout.recompute!r} recompute (train.recompute)")
    if layout.encoder_zero not in (0, 2):
        raise ValueError(f"the trainer has no encoder ZeRO-{layout.encoder_zero}")
    return {
        "parallelism": {
            "tensor": layout.tp,
            "pipeline": layout.pp,
            "virtualPipeline": layout.vpp,
            "sequenceParallel": layout.tp > 1 and layout.sequence_parallel,
            "distributedOptimizer": bool(layout.llm_zero),
            "overlapGradReduce": bool(layout.llm_zero) and layout.overlap_grad_reduce,
            "encoder": {"eta": layout.eta, "policy": policy, "zero": layout.encoder_zero},
        },
        "data": {
            "microBatchSize": layout.micro_batch_size,
            "reorder": {"groupSize": layout.reorder_group},
        },
        "train": {"recompute": layout.recompute},
    }


def tie_ranks(tokens_per_s: Sequence[float]) -> list[str]:
    """Rank labels, best first, with equal predictions sharing a rank (``1=``, ``1=``, ``3``)."""
    labels: list[str] = []
    for i, t in enumerate(tokens_per_s):
        tied_prev = i > 0 and abs(t - tokens_per_s[i - 1]) <= TIE * max(t, 1e-9)
        tied_next = i + 1 < len(tokens_per_s) and (
            abs(t - tokens_per_s[i + 1]) <= TIE * max(t, 1e-9)
        )
        rank = labels[-1].rstrip("=") if tied_prev else str(i + 1)
        labels.append(rank + ("=" if tied_prev or tied_next else ""))
    return labels


def with_layout(cfg: TrainerConfig, layout: Layout, *, policy: str) -> TrainerConfig:
    """``cfg`` with :func:`manifest_fields` of ``layout`` applied, validated as a manifest is
    (``model.llm.hf`` not read: ``models.config.DEFER_HF``).

    Raises:
        ValueError: a field the trainer's validation rejects, or a choice it cannot run.
    """
    doc = cfg.model_dump(mode="json", by_alias=True, exclude_unset=True)
    _merge(doc, manifest_fields(layout, policy=policy))
    try:
        return TrainerConfig.model_validate(doc, context={DEFER_HF: True})
    except ValidationError as err:
        raise ValueError(format_errors(err)) from None


def trainer_problems(cfg: TrainerConfig, layout: Layout, *, policy: str = "uniform") -> list[str]:
    """Why ``omni train`` would reject the manifest run with ``layout`` (empty: it accepts it):
    the tuner proposes only layouts without any."""
    try:
        patched = with_layout(cfg, layout, policy=policy)
    except ValueError as err:
        return [str(err)]
    return [f"{path}: {msg}" for path, msg in layout_problems(patched, layout.world_size)]


def _merge(into: dict[str, Any], fields: Mapping[str, Any]) -> None:
    for key, value in fields.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value
