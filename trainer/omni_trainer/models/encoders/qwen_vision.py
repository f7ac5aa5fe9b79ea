"""Qwen2.5-VL's vision tower built as our own module over packed batches of images and video.

Each image (or each pair of video frames, ``temporal_patch_size``) is its own grid of patches:
native dynamic resolution, no resizing beyond the processor's. Tokens stay in the processor's
order (every 2x2 block of patches contiguous, blocks row-major) from the patch embedding to the
merger, so the merger's output is already in the LLM's order. The 2D rotary embedding and the
attention partition (windows of ``window_units`` merged tokens in most blocks, whole frames in
``full_attention_blocks``) live in one attention kernel, :class:`WindowedRotaryCore`, that each
block puts inside the tower's :class:`~.layers.TokenMixer`: the mixer hands that kernel whole
samples both data-parallel and under Ulysses (after its all-to-all), so window attention and
rotary angles need no sharding logic of their own. The layout travels with the tokens
(:class:`LaidOut`) and each kernel is immutable, so a block or kernel rerun in the backward
(``train.recompute``) sees its own forward's layout and partition. The math equals transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` (which permutes tokens into window order and back;
attention within a window does not depend on the order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.models.encoders.layers import ACTIVATIONS, AttentionFn, TokenMixer, Varlen

Grid = tuple[int, int, int]
"""(temporal patches, patch rows, patch columns) of one image or video."""


@dataclass(frozen=True)
class TokenLayout:
    """Per-token state of one packed batch that attention needs: rotary angles and the two
    partitions of the tokens (frames for full attention, windows for the others)."""

    cos: Tensor
    """[tokens, head_dim] fp32."""
    sin: Tensor
    frames: Varlen
    """One segment per temporal frame of every sample."""
    window_order: Tensor
    """Token indices in window order (windows of one frame consecutive)."""
    window_inverse: Tensor
    """The inverse permutation of ``window_order``."""
    windows: Varlen
    """The windows over ``window_order``."""

    @property
    def tokens(self) -> int:
        return self.cos.shape[0]

    def to(self, device: torch.device) -> TokenLayout:
        """The layout's tensors on ``device`` (once per batch, not once per block; each
        :class:`Varlen` copies its boundaries there itself, once)."""
        return replace(
            self,
            cos=self.cos.to(device),
            sin=self.sin.to(device),
            window_order=self.window_order.to(device),
            window_inverse=self.window_inverse.to(device),
        )


@dataclass(frozen=True)
class LaidOut(Varlen):
    """Sample boundaries with the samples' :class:`TokenLayout` (from the tower's last embed):
    a block rerun in the backward gets the layout of its own forward with its arguments."""

    layout: TokenLayout | None = None


def grid_positions(grid: Grid, merge: int) -> Tensor:
    """[t*h*w, 2] (row, column) of every patch, in the processor's order (merge blocks
    contiguous), repeated for every temporal frame."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    pos = torch.stack([rows.permute(0, 2, 1, 3), cols.permute(0, 2, 1, 3)], dim=-1)
    return pos.reshape(-1, 2).repeat(t, 1)


def window_partition(grid: Grid, merge: int, units: int) -> tuple[Tensor, list[int]]:
    """Windows of ``units x units`` merged tokens over each frame, row-major (edge windows are
    cut short), as transformers' ``get_vision_window_index``.

    Returns:
        ``(order, lengths)``: the sample's token indices in window order, and tokens per window.
    """
    t, h, w = grid
    lh, lw = h // merge, w // merge
    nh, nw = math.ceil(lh / units), math.ceil(lw / units)
    index = F.pad(
        torch.arange(lh * lw).view(lh, lw), (0, nw * units - lw, 0, nh * units - lh), value=-1
    )
    index = index.view(nh, units, nw, units).permute(0, 2, 1, 3).reshape(nh * nw, units * units)
    valid = index >= 0
    per_window = (valid.sum(1) * merge * merge).tolist()
    unit_tokens = merge * merge
    frame = (index[valid][:, None] * unit_tokens + torch.arange(unit_tokens)).flatten()
    order = torch.cat([frame + f * h * w for f in range(t)])
    return order, per_window * t


def token_layout(
    grids: Sequence[Grid], *, merge: int, window_units: int, head_dim: int, theta: float
) -> TokenLayout:
    """The layout of samples of these grids packed in order (a pure function of the grids)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
    )
    angles, orders, windows, frames = [], [], [], []
    offset = 0
    for grid in grids:
        t, h, w = grid
        angles.append((grid_positions(grid, merge)[..., None] * inv_freq).flatten(1))
        order, lengths = window_partition(grid, merge, window_units)
        orders.append(order + offset)
        windows += lengths
        frames += [h * w] * t
        offset += t * h * w
    half = torch.cat(angles)  # [tokens, head_dim / 2]: row angles, then column angles
    full = torch.cat([half, half], dim=1)
    order = torch.cat(orders)
    return TokenLayout(
        cos=full.cos(),
        sin=full.sin(),
        frames=Varlen.of(frames),
        window_order=order,
        window_inverse=torch.argsort(order),
        windows=Varlen.of(windows),
    )


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of [tokens, heads, head_dim] in fp32 (as transformers), in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


@dataclass(frozen=True)
class WindowedRotaryCore:
    """The tower's attention kernel for one block: rotary angles, then ``inner`` attention
    within the windows (``windowed``) or within the frames of the tokens it is given.

    It is given whole samples: the packed batch :meth:`QwenVisionTower.embed` laid out, or under
    Ulysses the one sample that was embedded, gathered along the sequence for this rank's heads.
    The boundaries it is called with (whole samples) are replaced by the layout's partition.
    """

    inner: AttentionFn
    layout: TokenLayout
    windowed: bool

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, seqs: Varlen) -> Tensor:
        lay = self.layout
        if q.shape[0] != lay.tokens:
            raise RuntimeError(
                f"the Qwen2.5-VL attention got {q.shape[0]} tokens but a layout of {lay.tokens} "
                "tokens: encode_tokens must run on whole samples from the last embed (or their "
                "Ulysses shards)"
            )
        q, k = _rotate(q, lay.cos, lay.sin), _rotate(k, lay.cos, lay.sin)
        if not self.windowed:
            return self.inner(q, k, v, lay.frames)
        order = lay.window_order
        out = self.inner(q[order], k[order], v[order], lay.windows)
        return out[lay.window_inverse]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input's dtype (transformers' Qwen2 RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with biases."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size)
        self.act = ACTIVATIONS[activation]()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionAttention(nn.Module):
    """Fused QKV, the mixer's attention (rotary and partition in this block's kernel),
    projection."""

    def __init__(
        self, hidden_size: int, num_heads: int, mixer: TokenMixer, *, inner: AttentionFn,
        windowed: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.mixer = mixer
        self.inner = inner
        """The attention kernel over whole samples (the mixer's, before the tower's)."""
        self.windowed = windowed

    def forward(self, x: Tensor, seqs: LaidOut) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        self.mixer.core = WindowedRotaryCore(self.inner, seqs.layout, self.windowed)
        out = self.mixer.attention(q, k, v, seqs)
        return self.proj(out.reshape(n, self.num_heads * self.head_dim))


class QwenVisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(
        self, cfg: VisionEncoderConfig, mixer: TokenMixer, *, inner: AttentionFn, windowed: bool
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.tower.norm_epsilon
        self.norm1 = RMSNorm(h, eps)
        self.norm2 = RMSNorm(h, eps)
        self.attn = QwenVisionAttention(h, cfg.num_heads, mixer, inner=inner, windowed=windowed)
        self.mlp = GatedMLP(h, cfg.ffn_hidden_size, cfg.tower.activation)

    def forward(self, x: Tensor, seqs: LaidOut) -> Tensor:
        x = x + self.attn(self.norm1(x), seqs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm per patch, then each 2x2 block's patches concatenated through Linear, GELU,
    Linear to the LLM's width."""

    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        merged = cfg.hidden_size * cfg.qwen.merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.qwen.out_hidden_size)
        )

    def forward(self, x: Tensor) -> Tensor:
        """[patches, hidden] (whole merge blocks) -> [patches / merge^2, out_hidden_size]."""
        merged = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).view(x.shape[0] * x.shape[1] // merged, merged))


class QwenVisionTower(nn.Module):
    """Patch embedding (a Conv3d over ``temporal_patch_size`` frames), blocks, patch merger.

    Media are images [C, H, W] (repeated over the temporal patch, as the processor does) or
    video frames [F, C, H, W] (F a multiple of the temporal patch); sides multiples of
    ``patch_size x merge_size``.
    """

    drop_prefix = 0
    """Leading block outputs per sample that are not encoder output (none)."""

    def __init__(self, cfg: VisionEncoderConfig, *, mixer: TokenMixer | None = None) -> None:
        super().__init__()
        if cfg.qwen is None:
            raise ValueError("QwenVisionTower needs an imported Qwen2.5-VL config (hf)")
        self.cfg = cfg
        self.merge_unit = cfg.qwen.merge_size**2
        """Block tokens per output token: Ulysses shards of a long sample are multiples of it."""
        self.mixer = mixer if mixer is not None else TokenMixer()
        """Cross-token ops of every block; each block sets its windowed rotary kernel in it."""
        inner = self.mixer.core
        self.layout: TokenLayout | None = None
        """The samples of the last :meth:`embed`."""
        q = cfg.qwen
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            cfg.in_channels,
            cfg.hidden_size,
            kernel_size=(q.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            bias=False,
        )  # applied as one matmul over the flattened patches (the same operation)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(cfg, self.mixer, inner=inner, windowed=i not in q.full_attention_blocks)
            for i in range(cfg.num_layers)
        )
        self.merger = PatchMerger(cfg)

    def patchify(self, media: Tensor) -> tuple[Tensor, Grid]:
        """[C, H, W] or [F, C, H, W] -> ([t*h*w, C*T*p*p] patches in the processor's order,
        grid), as ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` flatten them."""
        cfg, q = self.cfg, self.cfg.qwen
        frames = media[None] if media.ndim == 3 else media
        if frames.ndim != 4 or frames.shape[1] != cfg.in_channels:
            raise ValueError(
                f"media must be [{cfg.in_channels}, H, W] or [frames, {cfg.in_channels}, H, W], "
                f"got {list(media.shape)}"
            )
        cfg.num_tokens(frames.shape[2], frames.shape[3])  # sides multiples of the merged patch
        tp, p, m = q.temporal_patch_size, cfg.patch_size, q.merge_size
        if media.ndim == 3:
            frames = frames.expand(tp, -1, -1, -1)
        elif frames.shape[0] % tp:
            raise ValueError(f"{frames.shape[0]} video frames is not a multiple of {tp}")
        f, c, height, width = frames.shape
        t, h, w = f // tp, height // p, width // p
        x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(t * h * w, c * tp * p * p), (t, h, w)

    def embed(self, media: Sequence[Tensor]) -> tuple[Tensor, list[int]]:
        """Patch embeddings of each whole sample, packed: ``(x, patches per sample)``; lays out
        the samples' rotary angles and windows for the blocks that follow."""
        if not media:
            raise ValueError("the vision tower needs at least one image")
        parts = [self.patchify(m) for m in media]
        weight = self.patch_embed.proj.weight
        x = F.linear(torch.cat([p for p, _ in parts]).to(weight.dtype), weight.flatten(1))
        grids = [g for _, g in parts]
        q = self.cfg.qwen
        self.layout = token_layout(
            grids,
            merge=q.merge_size,
            window_units=q.window_units,
            head_dim=self.cfg.hidden_size // self.cfg.num_heads,
            theta=q.rope_theta,
        ).to(x.device)
        return x, [t * h * w for t, h, w in grids]

    def encode_tokens(self, x: Tensor, seqs: Varlen) -> Tensor:
        """The blocks and the merger: [patches, hidden] (whole merge blocks, ``seqs`` their
        sample boundaries) -> [patches / merge^2, out_hidden_size]."""
        if self.layout is None:
            raise RuntimeError("the Qwen2.5-VL tower: encode_tokens needs an embed first")
        laid = LaidOut(seqs.lengths, layout=self.layout)
        return self.merger(self.mixer.run_blocks(self.blocks, x, laid))

    def forward(self, media: Sequence[Tensor]) -> Tensor:
        """[sum of output tokens, out_hidden_size], samples in the given order."""
        x, lengths = self.embed(media)
        return self.encode_tokens(x, Varlen.of(lengths))
