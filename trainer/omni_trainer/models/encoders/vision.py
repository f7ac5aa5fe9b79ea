"""ViT image encoder at native (dynamic) resolution, over packed batches of mixed image sizes.

Each image becomes its own ``h x w`` grid of patches with 2D sin-cos positions computed for that
grid, so there is no maximum resolution and no resizing or padding; each image attends to itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.models.encoders.layers import (
    AttentionFn,
    TransformerBlock,
    cu_seqlens_from_lengths,
    sincos_2d,
    varlen_attention,
)


class VisionEncoder(nn.Module):
    """Patch embedding, 2D sin-cos positions, pre-LN blocks, final LayerNorm."""

    def __init__(
        self, cfg: VisionEncoderConfig, *, attention_fn: AttentionFn = varlen_attention
    ) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        # Kept as a Conv2d (kernel = stride = patch) for checkpoint layout; applied as one matmul
        # over the patches of all images, which is the same operation.
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=p, stride=p)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                cfg.hidden_size, cfg.num_heads, cfg.ffn_hidden_size, attention_fn=attention_fn
            )
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

    def forward(self, images: Sequence[Tensor]) -> Tensor:
        """Encode images of any sizes (multiples of the patch) together.

        Args:
            images: each [C, H, W].

        Returns:
            [sum of (H/p)*(W/p), hidden]: each image's patches row-major, images in the given order.
        """
        if not images:
            raise ValueError("VisionEncoder needs at least one image")
        p = self.cfg.patch_size
        grids = [(img.shape[-2] // p, img.shape[-1] // p) for img in images]
        patches = torch.cat([self.patchify(img) for img in images])
        weight = self.patch_embed.weight.flatten(1)  # [hidden, C*p*p]
        x = F.linear(patches, weight, self.patch_embed.bias)
        pos = torch.cat([sincos_2d(h, w, self.cfg.hidden_size, device=x.device) for h, w in grids])
        x = x + pos.to(x.dtype)
        cu_seqlens = cu_seqlens_from_lengths([h * w for h, w in grids], device=x.device)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.norm(x)
