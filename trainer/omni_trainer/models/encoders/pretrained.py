"""Hugging Face encoder architectures built as our own modules: CLIP / SigLIP vision towers and
Whisper's audio encoder.

They are not wrappers around transformers' classes: like :class:`~.vision.VisionEncoder` they take
packed variable-length batches and route every cross-token op through one
:class:`~.layers.TokenMixer` (so Ulysses sequence parallelism and LSSP work unchanged), and split
``forward`` into ``embed`` (whole samples) and ``encode_tokens`` (the blocks). Weights come from
the checkpoint through ``interop/encoders.py``; the math equals transformers' (tested against
``CLIPVisionModel``, ``SiglipVisionModel`` and ``WhisperEncoder``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig
from omni_trainer.models.encoders.layers import (
    ACTIVATIONS,
    TokenMixer,
    TransformerBlock,
    Varlen,
    unpad,
)


def _blocks(cfg, mixer: TokenMixer) -> nn.ModuleList:
    """The pre-LN blocks both families share (LN, attention, LN, MLP)."""
    tower = cfg.tower
    return nn.ModuleList(
        TransformerBlock(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.ffn_hidden_size,
            mixer=mixer,
            eps=tower.norm_epsilon,
            activation=ACTIVATIONS[tower.activation],
        )
        for _ in range(cfg.num_layers)
    )


class TowerEmbedding(nn.Module):
    """Patch embedding, CLIP's class token, learned positions (bicubic-interpolated for other
    grids, as transformers' ``interpolate_pos_encoding``), CLIP's pre-LayerNorm."""

    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        tower, h, p = cfg.tower, cfg.hidden_size, cfg.patch_size
        self.prefix = cfg.prefix_tokens
        self.grid = tower.image_size // p
        self.conv = nn.Conv2d(cfg.in_channels, h, kernel_size=p, stride=p, bias=not self.prefix)
        self.class_embedding = nn.Parameter(torch.zeros(h)) if self.prefix else None
        self.position = nn.Embedding(self.grid * self.grid + self.prefix, h)
        self.pre_norm = nn.LayerNorm(h, eps=tower.norm_epsilon) if self.prefix else nn.Identity()

    def positions(self, rows: int, cols: int) -> Tensor:
        """[prefix + rows * cols, hidden] position embeddings of a ``rows x cols`` patch grid."""
        table = self.position.weight
        if rows == cols == self.grid:
            return table
        h = table.shape[1]
        grid = table[self.prefix :].reshape(1, self.grid, self.grid, h).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([table[: self.prefix], grid.permute(0, 2, 3, 1).reshape(rows * cols, h)])

    def forward(self, image: Tensor) -> Tensor:
        """[C, H, W] -> [prefix + (H/p) * (W/p), hidden], patches row-major."""
        patches = self.conv(image[None].to(self.conv.weight.dtype))  # [1, hidden, rows, cols]
        rows, cols = patches.shape[-2:]
        x = patches.flatten(2)[0].transpose(0, 1)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding[None].to(x.dtype), x])
        return self.pre_norm(x + self.positions(rows, cols).to(x.dtype))


class PretrainedVisionTower(nn.Module):
    """A CLIP or SigLIP vision tower up to its feature layer (LLaVA's ``vision_feature_layer``),
    whose output drops ``cfg.drop_prefix`` leading tokens per image (the class token)."""

    merge_unit = 1
    """Block tokens per output token."""

    def __init__(self, cfg: VisionEncoderConfig, *, mixer: TokenMixer | None = None) -> None:
        super().__init__()
        if cfg.tower is None:
            raise ValueError("PretrainedVisionTower needs an imported config (model.encoders.*.hf)")
        self.cfg = cfg
        self.mixer = mixer if mixer is not None else TokenMixer()
        """Cross-token ops of every block (one shared instance); not a module, holds no weights."""
        self.drop_prefix = cfg.drop_prefix
        """Leading block outputs of each sample that are not encoder output."""
        self.patch_embed = TowerEmbedding(cfg)
        self.blocks = _blocks(cfg, self.mixer)

    def embed(self, images: Sequence[Tensor]) -> tuple[Tensor, list[int]]:
        """Embedded tokens of each whole image, packed: ``(x, tokens per image)``."""
        if not images:
            raise ValueError("the vision tower needs at least one image")
        for img in images:
            if img.ndim != 3 or img.shape[0] != self.cfg.in_channels:
                raise ValueError(
                    f"images must be [{self.cfg.in_channels}, H, W], got {list(img.shape)}"
                )
            self.cfg.num_tokens(img.shape[1], img.shape[2])  # sides multiples of the patch
        parts = [self.patch_embed(img) for img in images]
        return torch.cat(parts), [part.shape[0] for part in parts]

    def encode_tokens(self, x: Tensor, seqs: Varlen) -> Tensor:
        """The blocks (the feature layer's hidden state): [tokens, hidden] -> same."""
        x = self.mixer.run_blocks(self.blocks, x, seqs)
        return x

    def forward(self, images: Sequence[Tensor]) -> Tensor:
        """[sum of output tokens, hidden], images in the given order (``cfg.num_tokens`` each)."""
        x, lengths = self.embed(images)
        out = self.encode_tokens(x, Varlen.of(lengths))
        if not self.drop_prefix:
            return out
        return torch.cat([part[self.drop_prefix :] for part in out.split(lengths)])


class WhisperAudioEncoder(nn.Module):
    """Whisper's encoder over packed clips of any even length up to its position table: conv
    (stride 1) + GELU, conv (stride 2) + GELU, learned positions from 0 in every clip, pre-LN
    blocks, final LayerNorm. Whisper has no key bias: the fused QKV's key bias stays zero (its
    gradient is masked)."""

    drop_prefix = 0
    merge_unit = 1

    def __init__(self, cfg: AudioEncoderConfig, *, mixer: TokenMixer | None = None) -> None:
        super().__init__()
        if cfg.tower is None:
            raise ValueError("WhisperAudioEncoder needs an imported config (model.encoders.*.hf)")
        self.cfg = cfg
        self.mixer = mixer if mixer is not None else TokenMixer()
        """Cross-token ops of every block (one shared instance); not a module, holds no weights."""
        h = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.n_mels, h, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(h, h, kernel_size=3, stride=2, padding=1)
        self.act = ACTIVATIONS[cfg.tower.activation]()
        self.positions = nn.Embedding(cfg.tower.max_positions, h)
        self.blocks = _blocks(cfg, self.mixer)
        self.norm = nn.LayerNorm(h, eps=cfg.tower.norm_epsilon)
        key_bias = torch.ones(3 * h)
        key_bias[h : 2 * h] = 0
        for block in self.blocks:
            block.attn.qkv.bias.register_hook(lambda g, m=key_bias: g * m.to(g.device, g.dtype))

    def embed(self, features: Sequence[Tensor]) -> tuple[Tensor, list[int]]:
        """Subsampled frames plus positions of each whole clip, packed: ``(x, tokens per clip)``.

        Each clip's valid outputs read only its own frames and the zeros a clip alone is padded
        with (lengths are even), so a clip's encoding does not depend on its batch-mates.
        """
        if not features:
            raise ValueError("the audio encoder needs at least one clip")
        cfg = self.cfg
        for f in features:
            if f.ndim != 2 or f.shape[1] != cfg.n_mels or f.shape[0] > cfg.max_frames:
                raise ValueError(
                    f"features must be [frames <= {cfg.max_frames}, {cfg.n_mels}], "
                    f"got {list(f.shape)}"
                )
        lengths = [cfg.num_tokens(f.shape[0]) for f in features]
        padded = nn.utils.rnn.pad_sequence(list(features), batch_first=True).transpose(1, 2)
        x = self.act(self.conv2(self.act(self.conv1(padded.to(self.conv1.weight.dtype)))))
        x = unpad(x.transpose(1, 2), Varlen.of(lengths))
        pos = torch.cat([self.positions.weight[:n] for n in lengths])
        return x + pos.to(x.dtype), lengths

    def encode_tokens(self, x: Tensor, seqs: Varlen) -> Tensor:
        """The blocks and the final LayerNorm: [tokens, hidden] -> same."""
        x = self.mixer.run_blocks(self.blocks, x, seqs)
        return self.norm(x)

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        """[sum of frames / 2, hidden] for clips of [frames, n_mels] log-mel features."""
        x, lengths = self.embed(features)
        return self.encode_tokens(x, Varlen.of(lengths))
