"""Encoder configs: presets, overrides, validation errors, parameter and FLOPs counts."""

from __future__ import annotations

import pydantic
import pytest

from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig


def test_preset_fills_and_explicit_fields_override() -> None:
    cfg = VisionEncoderConfig(preset="vit-g-14")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.ffn_hidden_size) == (
        1408,
        40,
        16,
        6144,
    )
    # YAML spelling (camelCase) overrides the preset too
    cfg = VisionEncoderConfig.model_validate(
        {"preset": "vit-l-14", "numLayers": 2, "patchSize": 16}
    )
    assert (cfg.hidden_size, cfg.num_layers, cfg.patch_size) == (1024, 2, 16)
    audio = AudioEncoderConfig(preset="conformer-tiny")
    assert (audio.hidden_size, audio.n_mels, audio.subsampling) == (64, 16, 4)
    assert AudioEncoderConfig(preset="conformer-tiny", n_mels=80).n_mels == 80


def test_without_preset_missing_fields_are_named() -> None:
    with pytest.raises(
        pydantic.ValidationError,
        match="numHeads, ffnHiddenSize: required when neither 'preset' nor 'hf' is given",
    ):
        VisionEncoderConfig(hidden_size=64, num_layers=2)


def test_invalid_shapes_are_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="divisible by num_heads"):
        VisionEncoderConfig(preset="vit-tiny", num_heads=3)
    with pytest.raises(pydantic.ValidationError, match="multiple of 4"):
        VisionEncoderConfig(hidden_size=6, num_layers=1, num_heads=2, ffn_hidden_size=8)
    with pytest.raises(pydantic.ValidationError, match="odd"):
        AudioEncoderConfig(preset="conformer-tiny", conv_kernel_size=4)
    with pytest.raises(pydantic.ValidationError, match="preset"):
        VisionEncoderConfig(preset="vit-xxl")
    with pytest.raises(pydantic.ValidationError, match="extra"):
        AudioEncoderConfig(preset="conformer-tiny", dropout=0.1)


def test_token_counts() -> None:
    cfg = VisionEncoderConfig(preset="vit-tiny")
    assert cfg.num_tokens(28, 56) == 2 * 4
    with pytest.raises(ValueError, match="patch_size"):
        cfg.num_tokens(30, 28)
    audio = AudioEncoderConfig(preset="conformer-tiny")
    assert audio.num_tokens(400) == 100
    with pytest.raises(ValueError, match="subsampling"):
        audio.num_tokens(402)


def test_public_model_sizes() -> None:
    # ViT-L: ~304M (ViT paper Table 1 / timm vit_large_patch16_224: 304.3M incl. head and pos)
    assert VisionEncoderConfig(preset="vit-l-14").params() == pytest.approx(303e6, rel=0.01)
    # ViT-H/14 632M (ViT paper), EVA ViT-g/14 ~1.0B, OpenCLIP ViT-bigG/14 ~1.84B
    assert VisionEncoderConfig(preset="vit-h-14").params() == pytest.approx(632e6, rel=0.01)
    assert VisionEncoderConfig(preset="vit-g-14").params() == pytest.approx(1.0e9, rel=0.02)
    assert VisionEncoderConfig(preset="vit-G-14").params() == pytest.approx(1.84e9, rel=0.02)
    # USM 2B: our Conformer reading of it has 1.75B encoder params (see config.py)
    assert AudioEncoderConfig(preset="usm-2b").params() == pytest.approx(1.75e9, rel=0.02)


def test_vit_l_flops_match_timm() -> None:
    # timm vit_large_patch16_224: 61.6 GMACs at 224px (196 patches + cls) -> 123 GFLOPs
    cfg = VisionEncoderConfig(preset="vit-l-14", patch_size=16)
    assert cfg.flops([cfg.num_tokens(224, 224)]) == pytest.approx(2 * 61.6e9, rel=0.03)


def test_flops_attention_is_per_sample() -> None:
    cfg = VisionEncoderConfig(preset="vit-tiny")
    one, two = cfg.flops([16]), cfg.flops([16, 16])
    assert two == 2 * one  # two separate images: no cross-image attention
    assert cfg.flops([32]) > two  # one image of twice the tokens pays 4x attention
    audio = AudioEncoderConfig(preset="conformer-tiny")
    assert audio.flops([10, 10]) == 2 * audio.flops([10])
