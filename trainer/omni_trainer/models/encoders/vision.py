"""ViT image encoder at native (dynamic) resolution, over packed batches of mixed image sizes.

Each image becomes its own ``h x w`` grid of patches with 2D sin-cos positions computed for that
grid, so there is no maximum resolution and no resizing or padding; each image attends to itself.
``forward`` is :meth:`VisionEncoder.embed` (per image, on whole images) then
:meth:`VisionEncoder.encode_tokens` (the blocks, whose only cross-token op is the mixer's
attention), so a long image's tokens can be sharded across ranks between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.models.encoders.layers import (
    TokenMixer,
    TransformerBlock,
    Varlen,
    sincos_2d,
)


class VisionEncoder(nn.Module):
    """Patch embedding, 2D sin-cos positions, pre-LN blocks, final LayerNorm."""

    drop_prefix = 0
    """Leading block outputs per sample that are not encoder output (none here)."""
    merge_unit = 1
    """Block tokens per output token."""

    def __init__(self, cfg: VisionEncoderConfig, *, mixer: TokenMixer | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.mixer = mixer if mixer is not None else TokenMixer()
        """Cross-token ops of every block (one shared instance); not a module, holds no weights."""
        p = cfg.patch_size
        # Kept as a Conv2d (kernel = stride = patch) for checkpoint layout; applied as one matmul
        # over the patches of all images, which is the same operation.
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=p, stride=p)
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg.hidden_size, cfg.num_heads, cfg.ffn_hidden_size, mixer=self.mixer)
            for _ in range(cfg.num_layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def patchify(self, image: Tensor) -> Tensor:
        """[C, H, W] -> [(H/p)*(W/p), C*p*p], row-major patches, channels in Conv2d weight order."""
        c, height, width = image.shape
        if c != self.cfg.in_channels:
            raise ValueError(f"image has {c} channels, expected {self.cfg.in_channels}")
        self.cfg.num_tokens(height, width)  # checks divisibility
        p = self.cfg.patch_size
        h, w = height // p, width // p
        return image.reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, c * p * p)

    def embed(self, images: Sequence[Tensor]) -> tuple[Tensor, list[int]]:
        """Patch embeddings plus 2D positions of each whole image, packed.

        Args:
            images: each [C, H, W], sides multiples of the patch.

        Returns:
            ``(x, lengths)``: x [sum of (H/p)*(W/p), hidden], each image's patches row-major, images
            in the given order; lengths: patches per image.
        """
        if not images:
            raise ValueError("VisionEncoder needs at least one image")
        p = self.cfg.patch_size
        grids = [(img.shape[-2] // p, img.shape[-1] // p) for img in images]
        patches = torch.cat([self.patchify(img) for img in images])
        weight = self.patch_embed.weight.flatten(1)  # [hidden, C*p*p]
        x = F.linear(patches, weight, self.patch_embed.bias)
        pos = torch.cat([sincos_2d(h, w, self.cfg.hidden_size, device=x.device) for h, w in grids])
        return x + pos.to(x.dtype), [h * w for h, w in grids]

    def encode_tokens(self, x: Tensor, seqs: Varlen) -> Tensor:
        """The blocks and the final LayerNorm: [tokens, hidden] -> [tokens, hidden].

        Args:
            x: packed token embeddings (from :meth:`embed`, or this rank's shard of one image when
                the mixer is sharded).
            seqs: sample boundaries of ``x`` (built once per batch, reused by every block).
        """
        x = self.mixer.run_blocks(self.blocks, x, seqs)
        return self.norm(x)

    def forward(self, images: Sequence[Tensor]) -> Tensor:
        """Encode images of any sizes (multiples of the patch) together.

        Args:
            images: each [C, H, W].

        Returns:
            [sum of (H/p)*(W/p), hidden]: each image's patches row-major, images in the given order.
        """
        x, lengths = self.embed(images)
        return self.encode_tokens(x, Varlen.of(lengths))
