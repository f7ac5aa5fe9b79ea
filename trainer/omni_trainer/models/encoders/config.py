"""Manifest sections of the modality encoders, with their parameter and FLOPs counts.

Torch-free: the operator imports these to validate a job manifest, and ``params()`` and ``flops()``
size encoder work, without torch installed. A ``preset`` fills the shape of a
public model; any shape field given explicitly overrides it; without a preset every shape field is
required. ``hf`` imports a Hugging Face tower instead (CLIP / SigLIP vision, Whisper audio): its
config.json sets the shape (a field beside it is an error) unless validation defers reading it
(:data:`DEFER_HF`: the operator cannot reach the pods' storage).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    model_validator,
)

from omni_trainer.config_base import Spec
from omni_trainer.costs.flops import attention_flops
from omni_trainer.interop.hf_config import SUPPORTED_AUDIO, SUPPORTED_VISION, HFTower

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


DEFER_HF = "defer_hf"
"""Validation context key: when true, no ``hf`` field (``model.llm.hf``, an encoder's ``hf``) is
read. The operator and ``omni render`` cannot reach the pods' storage (a PVC path, or S3 with the
job's own credentials), so those dimensions stay unknown there and the checks that need them run
where the job runs: ``omni train`` in every pod before training, and ``omni validate
--sources``."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def refuse_beside_hf(spec: Spec, names: set[str]) -> None:
    """Fields in ``names`` set beside ``hf`` are an error: the model's config.json sets them."""
    explicit = sorted(spec.model_fields_set & names)
    if explicit:
        raise ValueError(
            f"{', '.join(_camel(n) for n in explicit)} cannot be set beside 'hf': the "
            f"architecture comes from {spec.hf}/config.json (remove them, or drop 'hf')"
        )


def read_hf(hf: str, read: Callable[[dict[str, Any], str], Any]) -> Any:
    """``read(config.json, hf)``, its errors as ``hf: ...`` messages a manifest error shows."""
    from omni_trainer.interop.source import HFModelError, read_config

    try:
        return read(read_config(hf), hf)
    except KeyError as err:
        raise ValueError(f"hf: {hf}/config.json lacks {err}") from None
    except (HFModelError, OSError, ValueError) as err:
        raise ValueError(f"hf: {err}") from None
    except Exception as err:  # storage: botocore's credential and endpoint errors
        raise ValueError(
            f"hf: {hf}: cannot read config.json ({type(err).__name__}: {err}); "
            "check the path and the storage credentials"
        ) from None


class ImportableEncoder(Spec):
    """What an encoder section with an ``hf`` field shares: the imported tower's settings."""

    _tower: HFTower | None = PrivateAttr(None)

    @property
    def resolved(self) -> bool:
        """Whether the shape is known (false only for ``hf`` under ``DEFER_HF``)."""
        return self.num_layers is not None

    @property
    def tower(self) -> HFTower | None:
        """The imported tower's settings (None for our own encoders)."""
        return self._tower

    @property
    def merge_unit(self) -> int:
        """Block tokens per output token (Qwen2.5-VL's 2x2 merger: 4; otherwise 1)."""
        qwen = self._tower.qwen if self._tower is not None else None
        return qwen.merge_size**2 if qwen else 1

    @property
    def output_size(self) -> int:
        """Width of the encoder's output, the projector's input (Qwen2.5-VL's merger: the LLM's
        hidden size; otherwise the blocks' width)."""
        return (self._tower.output_size if self._tower else None) or self.hidden_size

    def _resolve_hf(self, info: ValidationInfo, shape_fields: tuple[str, ...], read) -> None:
        """Fill the shape fields from ``hf`` (``read(config, where)`` -> fields, tower), or
        check that every shape field is set when there is no ``hf``."""
        if self.hf is None:
            missing = [_camel(n) for n in shape_fields if getattr(self, n) is None]
            if missing:
                raise ValueError(
                    f"{', '.join(missing)}: required when neither 'preset' nor 'hf' is given"
                )
            return
        refuse_beside_hf(self, {"preset", *shape_fields})
        if (info.context or {}).get(DEFER_HF):
            return
        fields, self._tower = read_hf(self.hf, read)
        for name, value in fields.items():
            object.__setattr__(self, name, value)


def _check_heads(hidden_size: int, num_heads: int) -> None:
    """Heads must split the width evenly (``head_dim = hidden_size / num_heads``)."""
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )


_VISION_SHAPE = ("hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "patch_size")


class VisionEncoderConfig(ImportableEncoder):
    """A ViT over images of any resolution (multiples of the patch size), or an imported CLIP /
    SigLIP / Qwen2.5-VL vision tower (``hf``)."""

    hf: str | None = Field(
        None,
        description="a Hugging Face vision tower (local directory or s3:// prefix) whose "
        f"architecture and weights the encoder takes (supported: {', '.join(SUPPORTED_VISION)}; "
        "a dual encoder's vision_model only); its preprocessor_config.json sizes the images",
    )
    feature_layer: int = -2
    """With ``hf``: the hidden state given to the projector (LLaVA's ``vision_feature_layer``:
    -1 the last block's output, -2 the one before; later blocks are not built)."""
    feature_select: Literal["default", "full"] | None = None
    """With ``hf``: ``default`` drops the first output token (CLIP's class token), ``full`` keeps
    every token (LLaVA's ``vision_feature_select_strategy``). Unset: a VLM's own setting, else
    ``default`` for a tower with a class token (CLIP) and ``full`` for one without (SigLIP),
    so no patch is lost."""
    preset: VisionPreset | None = None
    """Public model whose shape fills the fields below that are not given."""
    hidden_size: PositiveInt | None = None
    """Token width; a multiple of 4 (2D sin-cos positions) and of ``num_heads``."""
    num_layers: PositiveInt | None = None
    """Transformer blocks."""
    num_heads: PositiveInt | None = None
    """Attention heads."""
    ffn_hidden_size: PositiveInt | None = None
    """MLP inner width."""
    patch_size: PositiveInt | None = None
    """Square patch side in pixels (default 14); image sides must be multiples of it."""
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
    def _check_shape(self, info: ValidationInfo) -> VisionEncoderConfig:
        if self.hf is None:
            if self.patch_size is None:
                object.__setattr__(self, "patch_size", 14)
            unset = self.model_fields_set & {"feature_layer", "feature_select"}
            if unset:
                raise ValueError(
                    f"{', '.join(_camel(n) for n in sorted(unset))}: only for an imported "
                    "tower ('hf')"
                )
        self._resolve_hf(info, _VISION_SHAPE, self._read_hf)
        if not self.resolved:
            return self
        if self._tower is not None and self.feature_select is None:
            select = "default" if self._tower.class_token else "full"
            object.__setattr__(self, "feature_select", select)
        feature = sorted(self.model_fields_set & {"feature_layer", "feature_select"})
        if self.qwen is not None and feature:
            raise ValueError(
                f"{', '.join(_camel(n) for n in feature)}: a Qwen2.5-VL tower outputs its "
                "merger's tokens (every block is used, none dropped); remove it"
            )
        _check_heads(self.hidden_size, self.num_heads)
        if self.freeze_layers is not None:
            start, stop = self.freeze_layers
            if not start < stop <= self.num_layers:
                raise ValueError(
                    f"freezeLayers [{start}, {stop}) must satisfy start < stop <= numLayers "
                    f"({self.num_layers})"
                )
        if self.hf is None and self.hidden_size % 4:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of 4 "
                "(sin and cos for rows and for columns)"
            )
        return self

    def _read_hf(self, config: dict[str, Any], where: str) -> tuple[dict[str, Any], HFTower]:
        """A VLM's own feature layer and selection apply unless the manifest sets them."""
        from omni_trainer.interop.hf_config import vision_fields, vlm_feature_settings

        for name, value in vlm_feature_settings(config).items():
            if name not in self.model_fields_set:
                object.__setattr__(self, name, value)
        return vision_fields(config, where, feature_layer=self.feature_layer)

    @property
    def qwen(self):
        """An imported Qwen2.5-VL tower's settings (``interop.qwen2_5_vl.QwenVision``), else
        None."""
        return self._tower.qwen if self._tower is not None else None

    @property
    def position_side(self) -> int:
        """Pixels along each side of the square one output token covers (the patch, or
        Qwen2.5-VL's 2x2 merged patches); image sides must be multiples of it."""
        return self.patch_size * (self.qwen.merge_size if self.qwen else 1)

    @property
    def prefix_tokens(self) -> int:
        """Tokens the blocks see before an image's patches (CLIP's class token)."""
        return int(self._tower is not None and self._tower.class_token)

    @property
    def drop_prefix(self) -> int:
        """Leading block outputs of each image left out of the encoder's output."""
        clip_like = self._tower is not None and self.qwen is None
        return int(clip_like and self.feature_select == "default")

    def num_tokens(self, height: int, width: int) -> int:
        """Encoder output tokens (= LLM positions) of one ``height x width`` image."""
        p = self.position_side
        if height % p or width % p:
            what = "patch_size x merge size" if self.qwen else "patch_size"
            raise ValueError(f"image {height}x{width} is not a multiple of {what} {p}")
        return (height // p) * (width // p) + self.prefix_tokens - self.drop_prefix

    def params(self) -> int:
        """Trainable parameters of the encoder module (``VisionEncoder``, or the imported
        tower's blocks up to the feature layer)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        # LN 2h, qkv 3h^2+3h, proj h^2+h, LN 2h, fc1 hf+f, fc2 fh+h
        block = 4 * h * h + 2 * h * f + 9 * h + f
        conv = self.in_channels * self.patch_size**2 * h
        if self._tower is None:
            return conv + h + self.num_layers * block + 2 * h  # + final LN
        if self.qwen is not None:
            return self._qwen_params()
        t = self._tower
        positions = (t.image_size // self.patch_size) ** 2 + self.prefix_tokens
        extra = 3 * h if t.class_token else h  # class token + pre-LN, or the conv's bias
        return conv + positions * h + extra + self.num_layers * block

    def _qwen_matmuls(self) -> tuple[int, int, int]:
        """Matmul weights of a Qwen2.5-VL tower: (patch embed, all blocks, merger)."""
        h, f, q = self.hidden_size, self.ffn_hidden_size, self.qwen
        conv = self.in_channels * q.temporal_patch_size * self.patch_size**2 * h
        merged = h * q.merge_size**2
        # qkv 3h^2, proj h^2, gate + up + down 3hf; merger: fc1 merged^2, fc2 merged x out
        blocks = self.num_layers * (4 * h * h + 3 * h * f)
        return conv, blocks, merged * (merged + q.out_hidden_size)

    def _qwen_params(self) -> int:
        """Parameters of ``QwenVisionTower``: matmuls, biases, RMSNorm weights."""
        h, f, q = self.hidden_size, self.ffn_hidden_size, self.qwen
        conv, blocks, merger = self._qwen_matmuls()
        # per block: 2 norms, qkv bias 3h, proj bias h, gate/up biases 2f, down bias h
        per_block_vectors = 2 * h + 3 * h + h + 2 * f + h
        merger_vectors = h + h * q.merge_size**2 + q.out_hidden_size  # ln_q, fc1 bias, fc2 bias
        return conv + blocks + merger + self.num_layers * per_block_vectors + merger_vectors

    def flops(self, token_lengths: Sequence[int]) -> float:
        """Forward FLOPs for images of these output token counts (see
        ``costs/flops.py``; Qwen2.5-VL: merge_size^2 patches per token, attention counted
        over whole images, an upper bound for its windowed blocks)."""
        if self.qwen is not None:
            conv, blocks, merger = self._qwen_matmuls()
            unit = self.qwen.merge_size**2
            patches = [n * unit for n in token_lengths]
            return 2.0 * ((conv + blocks) * sum(patches) + merger * sum(token_lengths)) + (
                attention_flops(
                    num_layers=self.num_layers,
                    num_heads=self.num_heads,
                    head_dim=self.hidden_size // self.num_heads,
                    seq_lengths=patches,
                )
            )
        h, f = self.hidden_size, self.ffn_hidden_size
        matmul_params = self.in_channels * self.patch_size**2 * h
        matmul_params += self.num_layers * (4 * h * h + 2 * h * f)
        return 2.0 * matmul_params * sum(token_lengths) + attention_flops(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=self.hidden_size // self.num_heads,
            seq_lengths=token_lengths,
        )


_AUDIO_SHAPE = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "ffn_hidden_size",
    "n_mels",
    "subsampling",
)


class AudioEncoderConfig(ImportableEncoder):
    """A Conformer over log-mel features, subsampled 4x in time before the blocks, or an
    imported Whisper encoder (``hf``, subsampled 2x)."""

    hf: str | None = Field(
        None,
        description="a Hugging Face Whisper model (local directory or s3:// prefix) whose "
        f"encoder's architecture and weights the audio encoder takes (supported: "
        f"{', '.join(SUPPORTED_AUDIO)})",
    )
    preset: AudioPreset | None = None
    """Public model whose shape fills the fields below that are not given."""
    hidden_size: PositiveInt | None = None
    """Token width; even (sinusoidal positions) and a multiple of ``num_heads``."""
    num_layers: PositiveInt | None = None
    """Conformer blocks."""
    num_heads: PositiveInt | None = None
    """Attention heads."""
    ffn_hidden_size: PositiveInt | None = None
    """Inner width of each of the two half-step feed-forward modules."""
    n_mels: PositiveInt | None = None
    """Mel bins per input frame (default 80)."""
    subsampling: Literal[2, 4] | None = None
    """Time reduction before the blocks (the Conformer: 4, two stride-2 convs; Whisper: 2);
    input frames must be a multiple."""
    conv_kernel_size: PositiveInt = 15
    """Depthwise convolution width in frames (odd, so 'same' padding is symmetric)."""
    freeze: bool = False
    """Train none of the encoder's weights: no gradients, optimizer state or backward."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        return _fill_from_preset(cls, data, _AUDIO_PRESETS)

    @model_validator(mode="after")
    def _check_shape(self, info: ValidationInfo) -> AudioEncoderConfig:
        if self.hf is None:
            for name, default in (("n_mels", 80), ("subsampling", 4)):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
            if self.subsampling != 4:
                raise ValueError("subsampling: the Conformer subsamples by 4 (2 is Whisper's)")
        self._resolve_hf(info, _AUDIO_SHAPE, _read_audio_hf)
        if not self.resolved:
            return self
        _check_heads(self.hidden_size, self.num_heads)
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be even (sin and cos)")
        if self.conv_kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel_size ({self.conv_kernel_size}) must be odd")
        return self

    @property
    def max_frames(self) -> int | None:
        """Longest clip in input frames (Whisper's position table); None: no limit."""
        return None if self._tower is None else self._tower.max_positions * self.subsampling

    def num_tokens(self, frames: int) -> int:
        """Encoder output tokens for ``frames`` mel frames."""
        if frames % self.subsampling:
            raise ValueError(f"{frames} frames is not a multiple of subsampling {self.subsampling}")
        return frames // self.subsampling

    def params(self) -> int:
        """Trainable parameters of :class:`~omni_trainer.models.encoders.audio.AudioEncoder`
        (or of the imported Whisper encoder)."""
        h, f, k = self.hidden_size, self.ffn_hidden_size, self.conv_kernel_size
        if self._tower is not None:  # conv1, conv2, positions, blocks as the ViT's, final LN
            block = 4 * h * h + 2 * h * f + 9 * h + f
            convs = 3 * self.n_mels * h + h + 3 * h * h + h
            return convs + self._tower.max_positions * h + self.num_layers * block + 2 * h
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
        attention = attention_flops(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=h // self.num_heads,
            seq_lengths=token_lengths,
        )
        # conv1 runs at 2x the output rate (frames / 2 positions), conv2 at the output rate
        # (Whisper too: its conv1 keeps the frame rate, its frames are 2x its tokens).
        subsample = 2.0 * (3 * self.n_mels * h) * 2 * tokens + 2.0 * (3 * h * h) * tokens
        if self._tower is not None:  # Whisper: blocks as the ViT's
            return subsample + 2.0 * self.num_layers * (4 * h * h + 2 * h * f) * tokens + attention
        per_token = 4 * h * f + 4 * h * h + 3 * h * h + h * k  # 2 FFNs, attention, conv module
        return subsample + 2.0 * self.num_layers * per_token * tokens + attention


def _read_audio_hf(config: dict[str, Any], where: str) -> tuple[dict[str, Any], HFTower]:
    from omni_trainer.interop.hf_config import audio_fields

    return audio_fields(config, where)
