"""Manifest sections of the modality encoders, with their parameter and FLOPs counts.

Torch-free: the operator imports these to validate a job manifest, and ``params()`` and ``flops()``
size encoder work, without torch installed. A ``preset`` fills the shape of a
public model; any shape field given explicitly overrides it; without a preset every shape field is
required (pydantic names the missing field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from omni_trainer.components.flops import attention_flops
from omni_trainer.config_base import Spec

VisionPreset = Literal["vit-tiny", "vit-l-14", "vit-g-14", "vit-h-14", "vit-G-14"]
AudioPreset = Literal["conformer-tiny", "usm-2b"]

# Sources: ViT-L and ViT-H: Dosovitskiy et al. 2021 (ViT), Table 1; patch 14 as in CLIP ViT-L/14 and
# open_clip `model_configs/ViT-H-14.json`. ViT-g/14: EVA-CLIP (open_clip `EVA01-g-14.json`: width
# 1408, 40 layers, head_width 88 -> 16 heads, mlp_ratio 4.3637 -> 6144). ViT-G/14: open_clip
# `ViT-bigG-14.json` (width 1664, 48 layers, head_width 104 -> 16 heads, mlp_ratio 4.9231 -> 8192).
# vit-tiny is ours, for CPU tests.
_VISION_PRESETS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {
        "vit-tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 256},
        "vit-l-14": {
            "hidden_size": 1024,
            "num_layers": 24,
            "num_heads": 16,
            "ffn_hidden_size": 4096,
        },
        "vit-h-14": {
            "hidden_size": 1280,
            "num_layers": 32,
            "num_heads": 16,
            "ffn_hidden_size": 5120,
        },
        "vit-g-14": {
            "hidden_size": 1408,
            "num_layers": 40,
            "num_heads": 16,
            "ffn_hidden_size": 6144,
        },
        "vit-G-14": {
            "hidden_size": 1664,
            "num_layers": 48,
            "num_heads": 16,
            "ffn_hidden_size": 8192,
        },
    }
)

# usm-2b: Zhang et al. 2023, "Google USM" (arXiv:2303.01037): the 2B model is a 32-layer Conformer
# of width 1536 on 128-dim log-mel features. Heads (16) and FFN width (4 x 1536) are the Conformer
# defaults (Gulati et al. 2020), not published for USM; this shape counts ~1.74B encoder params.
# conformer-tiny is ours, for CPU tests.
_AUDIO_PRESETS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {
        "conformer-tiny": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "ffn_hidden_size": 256,
            "n_mels": 16,
        },
        "usm-2b": {
            "hidden_size": 1536,
            "num_layers": 32,
            "num_heads": 16,
            "ffn_hidden_size": 6144,
            "n_mels": 128,
        },
    }
)


def _fill_from_preset(cls: type[Spec], data: Any, presets: Mapping[str, Mapping[str, int]]) -> Any:
    """Add the preset's values for the shape fields the manifest leaves out (by name or alias)."""
    if not isinstance(data, dict) or data.get("preset") not in presets:
        return data  # an unknown preset is reported by the Literal check
    filled = dict(data)
    for name, value in presets[data["preset"]].items():
        if name not in filled and cls.model_fields[name].alias not in filled:
            filled[name] = value
    return filled


def _check_heads(hidden_size: int, num_heads: int) -> None:
    """Heads must split the width evenly (``head_dim = hidden_size / num_heads``)."""
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )


class VisionEncoderConfig(Spec):
    """A ViT over images of any resolution (multiples of the patch size)."""

    preset: VisionPreset | None = None
    """Public model whose shape fills the fields below that are not given."""
    hidden_size: PositiveInt
    """Token width; a multiple of 4 (2D sin-cos positions) and of ``num_heads``."""
    num_layers: PositiveInt
    """Transformer blocks."""
    num_heads: PositiveInt
    """Attention heads."""
    ffn_hidden_size: PositiveInt
    """MLP inner width."""
    patch_size: PositiveInt = 14
    """Square patch side in pixels; image sides must be multiples of it."""
    in_channels: PositiveInt = 3
    """Image channels."""
    freeze: bool = False
    """Train none of the encoder's weights: no gradients, optimizer state or backward."""
    freeze_layers: list[NonNegativeInt] | None = Field(None, min_length=2, max_length=2)
    """``[start, stop]``: freeze blocks start..stop-1 (and the patch embedding when start is 0)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        return _fill_from_preset(cls, data, _VISION_PRESETS)

    @model_validator(mode="after")
    def _check_shape(self) -> VisionEncoderConfig:
        _check_heads(self.hidden_size, self.num_heads)
        if self.freeze_layers is not None:
            start, stop = self.freeze_layers
            if not start < stop <= self.num_layers:
                raise ValueError(
                    f"freezeLayers [{start}, {stop}) must satisfy start < stop <= numLayers "
                    f"({self.num_layers})"
                )
        if self.hidden_size % 4:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of 4 "
                "(sin and cos for rows and for columns)"
            )
        return self

    def num_tokens(self, height: int, width: int) -> int:
        """Patches (= encoder output tokens) of one ``height x width`` image."""
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(f"image {height}x{width} is not a multiple of patch_size {p}")
        return (height // p) * (width // p)

    def params(self) -> int:
        """Trainable parameters of :class:`~omni_trainer.models.encoders.vision.VisionEncoder`."""
        h, f = self.hidden_size, self.ffn_hidden_size
        patch_embed = self.in_channels * self.patch_size**2 * h + h
        # LN 2h, qkv 3h^2+3h, proj h^2+h, LN 2h, fc1 hf+f, fc2 fh+h
        block = 4 * h * h + 2 * h * f + 9 * h + f
        return patch_embed + self.num_layers * block + 2 * h

    def flops(self, token_lengths: Sequence[int]) -> float:
        """Forward FLOPs for images of these patch counts (see ``components/flops.py``)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        matmul_params = self.in_channels * self.patch_size**2 * h
        matmul_params += self.num_layers * (4 * h * h + 2 * h * f)
        return 2.0 * matmul_params * sum(token_lengths) + attention_flops(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=self.hidden_size // self.num_heads,
            seq_lengths=token_lengths,
        )


class AudioEncoderConfig(Spec):
    """A Conformer over log-mel features, subsampled 4x in time before the blocks."""

    preset: AudioPreset | None = None
    """Public model whose shape fills the fields below that are not given."""
    hidden_size: PositiveInt
    """Token width; even (sinusoidal positions) and a multiple of ``num_heads``."""
    num_layers: PositiveInt
    """Conformer blocks."""
    num_heads: PositiveInt
    """Attention heads."""
    ffn_hidden_size: PositiveInt
    """Inner width of each of the two half-step feed-forward modules."""
    n_mels: PositiveInt = 80
    """Mel bins per input frame."""
    subsampling: Literal[4] = 4
    """Time reduction before the blocks (two stride-2 convs); input frames must be a multiple."""
    conv_kernel_size: PositiveInt = 15
    """Depthwise convolution width in frames (odd, so 'same' padding is symmetric)."""
    freeze: bool = False
    """Train none of the encoder's weights: no gradients, optimizer state or backward."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        return _fill_from_preset(cls, data, _AUDIO_PRESETS)

    @model_validator(mode="after")
    def _check_shape(self) -> AudioEncoderConfig:
        _check_heads(self.hidden_size, self.num_heads)
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be even (sin and cos)")
        if self.conv_kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel_size ({self.conv_kernel_size}) must be odd")
        return self

    def num_tokens(self, frames: int) -> int:
        """Encoder output tokens for ``frames`` mel frames."""
        if frames % self.subsampling:
            raise ValueError(f"{frames} frames is not a multiple of subsampling {self.subsampling}")
        return frames // self.subsampling

    def params(self) -> int:
        """Trainable parameters of :class:`~omni_trainer.models.encoders.audio.AudioEncoder`."""
        h, f, k = self.hidden_size, self.ffn_hidden_size, self.conv_kernel_size
        subsample = (3 * self.n_mels * h + h) + (3 * h * h + h)
        ffn = 2 * h * f + f + 3 * h  # LN, fc1, fc2
        attn = 4 * h * h + 6 * h  # LN, qkv, proj
        conv = 3 * h * h + h * k + 8 * h  # LN, pointwise h->2h, depthwise, LN, pointwise h->h
        block = 2 * ffn + attn + conv + 2 * h  # + final LN
        return subsample + self.num_layers * block

    def flops(self, token_lengths: Sequence[int]) -> float:
        """Forward FLOPs for clips of these output token counts (input frames = 4 x tokens)."""
        h, f, k = self.hidden_size, self.ffn_hidden_size, self.conv_kernel_size
        tokens = sum(token_lengths)
        # conv1 runs at 2x the output rate (frames / 2 positions), conv2 at the output rate.
        subsample = 2.0 * (3 * self.n_mels * h) * 2 * tokens + 2.0 * (3 * h * h) * tokens
        per_token = 4 * h * f + 4 * h * h + 3 * h * h + h * k  # 2 FFNs, attention, conv module
        return (
            subsample
            + 2.0 * self.num_layers * per_token * tokens
            + attention_flops(
                num_layers=self.num_layers,
                num_heads=self.num_heads,
                head_dim=h // self.num_heads,
                seq_lengths=token_lengths,
            )
        )
