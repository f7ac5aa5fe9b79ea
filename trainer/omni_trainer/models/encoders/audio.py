"""Conformer audio encoder (Gulati et al. 2020) over packed batches of variable-length clips.

Departures from the paper, each so that a clip's output does not depend on its batch-mates:
BatchNorm in the convolution module is a LayerNorm over channels; the time convolutions run on a
per-sample zero-padded view (:func:`pad_packed`), which equals convolving each clip alone. Positions
are absolute sinusoids added once after subsampling, restarting at 0 in every clip, instead of
Transformer-XL relative attention: attention stays plain softmax, so the one ``varlen_attention``
core (and FlashAttention / Ulysses around it) serves the audio encoder as it does the ViT. The
blocks' cross-token ops (attention, the depthwise convolution) go through one shared
:class:`~omni_trainer.models.encoders.layers.TokenMixer`; ``forward`` is
:meth:`AudioEncoder.embed` (subsampling and positions, on whole clips) then
:meth:`AudioEncoder.encode_tokens` (the blocks), so a long clip can be sharded between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from omni_trainer.models.encoders.config import AudioEncoderConfig
from omni_trainer.models.encoders.layers import (
    MLP,
    MultiHeadSelfAttention,
    TokenMixer,
    Varlen,
    pad_packed,
    sincos_1d,
    unpad,
)


class ConvSubsampling(nn.Module):
    """Two Conv1d (kernel 3, stride 2, padding 1) + GELU over time: frames -> frames / 4 tokens."""

    def __init__(self, n_mels: int, hidden_size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, hidden_size, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(hidden_size, hidden_size, kernel_size=3, stride=2, padding=1)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        """[batch, frames, n_mels] zero-padded -> [batch, frames / 4, hidden].

        Each valid output reads only its own clip's frames (and the zeros past its end that a
        clip alone would be padded with), since every clip length is a multiple of 4.
        """
        x = self.act(self.conv1(x.transpose(1, 2)))
        return self.act(self.conv2(x)).transpose(1, 2)


class ConvModule(nn.Module):
    """LN, pointwise h->2h, GLU, depthwise conv, LN (for BatchNorm), SiLU, pointwise h->h."""

    def __init__(
        self, hidden_size: int, kernel_size: int, *, mixer: TokenMixer | None = None
    ) -> None:
        super().__init__()
        self.mixer = mixer if mixer is not None else TokenMixer()
        """Gathers whole clips around the depthwise conv (a no-op unless sequence-sharded)."""
        self.norm = nn.LayerNorm(hidden_size)
        self.pointwise_in = nn.Linear(hidden_size, 2 * hidden_size)  # == Conv1d(kernel 1)
        self.glu = nn.GLU(dim=-1)
        self.depthwise = nn.Conv1d(
            hidden_size, hidden_size, kernel_size, padding=kernel_size // 2, groups=hidden_size
        )
        self.conv_norm = nn.LayerNorm(hidden_size)
        self.act = nn.SiLU()
        self.pointwise_out = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor, seqs: Varlen) -> Tensor:
        """[total, hidden] -> [total, hidden]; the depthwise conv never crosses a clip boundary."""
        x = self.glu(self.pointwise_in(self.norm(x)))
        x_full, seqs_full = self.mixer.gather_sequence(x, seqs)
        padded = pad_packed(x_full, seqs_full).transpose(1, 2)  # [batch, hidden, max_len]
        x = self.mixer.scatter_sequence(unpad(self.depthwise(padded).transpose(1, 2), seqs_full))
        return self.pointwise_out(self.act(self.conv_norm(x)))


class FeedForward(nn.Module):
    """Pre-LN Swish feed-forward module of a Conformer block (added with weight 1/2)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.mlp = MLP(hidden_size, ffn_hidden_size, activation=nn.SiLU)

    def forward(self, x: Tensor) -> Tensor:
        """Per-token."""
        return self.mlp(self.norm(x))


class ConformerBlock(nn.Module):
    """``x + FFN/2``, ``x + MHSA``, ``x + Conv``, ``x + FFN/2``, LayerNorm (the macaron layout)."""

    def __init__(self, cfg: AudioEncoderConfig, *, mixer: TokenMixer | None = None) -> None:
        super().__init__()
        mixer = mixer if mixer is not None else TokenMixer()
        self.ffn1 = FeedForward(cfg.hidden_size, cfg.ffn_hidden_size)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size)
        self.attn = MultiHeadSelfAttention(cfg.hidden_size, cfg.num_heads, mixer=mixer)
        self.conv = ConvModule(cfg.hidden_size, cfg.conv_kernel_size, mixer=mixer)
        self.ffn2 = FeedForward(cfg.hidden_size, cfg.ffn_hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x: Tensor, seqs: Varlen) -> Tensor:
        """[total, hidden] -> [total, hidden]."""
        x = x + 0.5 * self.ffn1(x)
        x = x + self.attn(self.attn_norm(x), seqs)
        x = x + self.conv(x, seqs)
        x = x + 0.5 * self.ffn2(x)
        return self.norm(x)


class AudioEncoder(nn.Module):
    """Conv subsampling x4, sinusoidal positions, Conformer blocks."""

    drop_prefix = 0
    """Leading block outputs per sample that are not encoder output (none here)."""
    merge_unit = 1
    """Block tokens per output token."""

    def __init__(self, cfg: AudioEncoderConfig, *, mixer: TokenMixer | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.mixer = mixer if mixer is not None else TokenMixer()
        """Cross-token ops of every block (one shared instance); not a module, holds no weights."""
        self.subsample = ConvSubsampling(cfg.n_mels, cfg.hidden_size)
        self.blocks = nn.ModuleList(
            ConformerBlock(cfg, mixer=self.mixer) for _ in range(cfg.num_layers)
        )

    def embed(self, features: Sequence[Tensor]) -> tuple[Tensor, list[int]]:
        """Subsampled frames plus sinusoidal positions of each whole clip, packed.

        Args:
            features: each [frames, n_mels] log-mel features, frames a multiple of 4.

        Returns:
            ``(x, lengths)``: x [sum of frames / 4, hidden], clips in the given order; lengths:
            tokens per clip.
        """
        if not features:
            raise ValueError("AudioEncoder needs at least one clip")
        for f in features:
            if f.ndim != 2 or f.shape[1] != self.cfg.n_mels:
                raise ValueError(
                    f"features must be [frames, {self.cfg.n_mels}], got {list(f.shape)}"
                )
        lengths = [self.cfg.num_tokens(f.shape[0]) for f in features]
        padded = nn.utils.rnn.pad_sequence(list(features), batch_first=True)
        x = unpad(self.subsample(padded), Varlen.of(lengths))
        positions = torch.cat([torch.arange(n, device=x.device) for n in lengths])
        return x + sincos_1d(positions, self.cfg.hidden_size).to(x.dtype), lengths

    def encode_tokens(self, x: Tensor, seqs: Varlen) -> Tensor:
        """The Conformer blocks (each ends in its LayerNorm): [tokens, hidden] -> [tokens, hidden].

        Args:
            x: packed token embeddings (from :meth:`embed`, or this rank's shard of one clip when
                the mixer is sharded).
            seqs: sample boundaries of ``x`` (built once per batch, reused by every block).
        """
        x = self.mixer.run_blocks(self.blocks, x, seqs)
        return x

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        """Encode clips of any lengths (multiples of 4 frames) together.

        Args:
            features: each [frames, n_mels] log-mel features.

        Returns:
            [sum of frames / 4, hidden], clips in the given order.
        """
        x, lengths = self.embed(features)
        return self.encode_tokens(x, Varlen.of(lengths))
