"""What ``omni plan --tune`` reads from the manifest: the GPU it runs on, and its own layout
(scored beside the tuner's best, so the gain of switching is visible)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omni_trainer.config import TrainerConfig
from omni_trainer.planner.costs import Layout
from omni_trainer.planner.devices import PROFILES, DeviceProfile

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
    group = cfg.data.reorder.group_size
    if dp % group:
        return None, f"reorder groupSize {group} does not divide data parallel {dp}"
    layout = Layout(
        tp=par.tensor,
        pp=par.pipeline,
        vpp=par.virtual_pipeline,
        dp=dp,
        micro_batch_size=cfg.data.micro_batch_size,
        encoder_zero=par.encoder_zero(dp),
        eta=par.encoder.eta,
        reorder_group=group,
    )
    return layout, "the manifest's"


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
