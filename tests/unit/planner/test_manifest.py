"""`omni plan --tune` reads the GPU and the job's own layout from the manifest."""

from __future__ import annotations

import pytest

from omni_trainer.config import parse_manifest
from omni_trainer.planner.devices import A100, GH200, H100, H200
from omni_trainer.planner.manifest import device_for, own_layout, tie_ranks


def _selector(product: str) -> dict:
    return {"scheduling": {"nodeSelector": {"nvidia.com/gpu.product": product}}}


def test_device_from_flag_then_manifest_then_default() -> None:
    assert device_for("h200", _selector("NVIDIA-A100-SXM4-80GB")) == (H200, "--device")
    device, why = device_for(None, _selector("NVIDIA-GH200-480GB"))
    assert device == GH200 and "nvidia.com/gpu.product=NVIDIA-GH200-480GB" in why
    assert device_for(None, _selector("NVIDIA-A100-SXM4-80GB"))[0] == A100
    assert device_for(None, {}) == (H100, "default; the manifest names no GPU product")
    with pytest.raises(ValueError, match="--device must be one of H100, H200, GH200, A100"):
        device_for("B200", None)


def test_own_layout_is_the_manifests(tiny_manifest: dict) -> None:
    trainer = tiny_manifest["spec"]["trainer"]
    trainer["parallelism"] = {"tensor": 2, "pipeline": 2, "encoder": {"eta": 64, "zero": 2}}
    trainer["data"]["reorder"] = {"groupSize": 2}
    cfg = parse_manifest(tiny_manifest).spec.trainer
    layout, _ = own_layout(cfg, 16)
    assert layout is not None
    assert (layout.tp, layout.pp, layout.dp, layout.eta, layout.reorder_group) == (2, 2, 4, 64, 2)
    assert layout.micro_batch_size == 4 and layout.encoder_zero == 2
    none, why = own_layout(cfg, 6)
    assert none is None and "tensor x pipeline (4) does not divide 6 GPUs" in why


def test_ties_share_a_rank() -> None:
    assert tie_ranks([100.0, 100.0, 90.0, 80.0, 80.00001]) == ["1=", "1=", "3", "4=", "4="]
    assert tie_ranks([3.0, 2.0, 1.0]) == ["1", "2", "3"]
