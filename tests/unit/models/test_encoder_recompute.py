"""Encoder activation recompute (``train.recompute`` applies to the encoders too): the same
outputs and gradients as without, fewer bytes kept for the backward. The sharded (Ulysses) case,
where the backward runs after the sample's sharded forward has ended: tests/dist/test_ulysses.py.
The Qwen2.5-VL tower's blocks differ in their attention partition (windows or frames): a rerun
must take its own block's."""

from __future__ import annotations

import json

import pytest
import torch

from omni_trainer.components.memory import SavedActivationMeter
from omni_trainer.models.encoders.audio import AudioEncoder
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig
from omni_trainer.models.encoders.qwen_vision import QwenVisionTower
from omni_trainer.models.encoders.vision import VisionEncoder
from omni_trainer.models.recompute import Recompute
from tests.unit.interop.hf_models import QWEN_VISION


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> VisionEncoderConfig:
    """A tiny Qwen2.5-VL tower's config (random init): window and full-attention blocks."""
    root = tmp_path_factory.mktemp("qwen")
    config = {"architectures": ["Qwen2_5_VisionTransformerPretrainedModel"],
              "model_type": "qwen2_5_vl_vision", **QWEN_VISION}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return VisionEncoderConfig(hf=str(root))


def build(which: str, qwen: VisionEncoderConfig | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    if which == "qwen":
        return QwenVisionTower(qwen)
    if which == "vision":
        return VisionEncoder(VisionEncoderConfig(preset="vit-tiny"))
    return AudioEncoder(AudioEncoderConfig(preset="conformer-tiny"))


def inputs(which: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if which == "qwen":  # 8-pixel merged tokens, windows of 2 x 2 of them
        return [torch.randn(3, 8 * h, 8 * w, generator=gen) for h, w in ((5, 7), (2, 4), (3, 3))]
    if which == "vision":
        return [torch.randn(3, 28 * h, 28 * w, generator=gen) for h, w in ((3, 5), (4, 4), (1, 2))]
    n_mels = AudioEncoderConfig(preset="conformer-tiny").n_mels
    return [torch.randn(n, n_mels, generator=gen) for n in (160, 96, 240)]


def run(
    which: str, recompute: Recompute, qwen: VisionEncoderConfig | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    enc = build(which, qwen)
    enc.mixer.recompute = recompute
    meter = SavedActivationMeter(enc.parameters())
    with meter.recording():
        out = enc(inputs(which))
    peak = meter.take_peak()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad for n, p in enc.named_parameters()}, peak


@pytest.mark.parametrize("which", ["vision", "audio", "qwen"])
def test_recompute_changes_memory_not_math(which: str, request) -> None:
    tower = request.getfixturevalue("qwen") if which == "qwen" else None
    out, grads, none_peak = run(which, Recompute(), tower)
    peaks = {}
    for mode in ("selective", "full"):
        got, got_grads, peaks[mode] = run(which, Recompute(mode), tower)
        torch.testing.assert_close(got, out, rtol=0, atol=0)
        assert got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert peaks["full"] < 0.5 * none_peak, (peaks, none_peak)
    assert peaks["selective"] < none_peak, (peaks, none_peak)


def test_full_recompute_of_the_first_layers_only() -> None:
    _, _, all_layers = run("vision", Recompute("full"))
    _, _, one_layer = run("vision", Recompute("full", layers=1))
    _, _, none = run("vision", Recompute())
    assert all_layers < one_layer < none


def test_no_recompute_without_autograd() -> None:
    """A frozen encoder (no graph) runs plainly: nothing is checkpointed, nothing kept."""
    enc = build("vision")
    enc.mixer.recompute = Recompute("full")
    with torch.no_grad():
        out = enc(inputs("vision"))
    assert not out.requires_grad
