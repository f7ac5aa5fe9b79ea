"""Blocks shared by the modality encoders, over packed variable-length batches.

The samples of a micro-batch are packed along the token axis (``x``: [total_tokens, hidden]) and
delimited by a :class:`Varlen`: their lengths, known on the host from metadata when the batch is
built, and the ``cu_seqlens`` FlashAttention's varlen kernels take, copied to the device once per
batch. Every layer reuses both, so no layer reads anything back from the device (no host sync).
No padding is computed, and a sample's output never depends on which samples share its batch.
Every op through which the tokens of one sample mix goes through one :class:`TokenMixer`, shared
by all layers of an encoder: attention (:meth:`TokenMixer.attention`) and the Conformer's
depthwise convolution (:meth:`TokenMixer.gather_sequence` / :meth:`TokenMixer.scatter_sequence`
around it). Everything else is per token, so sequence parallelism (``models/ulysses.py``)
replaces the mixer and no block changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from omni_trainer.models.recompute import Recompute


@dataclass(frozen=True)
class Varlen:
    """Sample boundaries of a packed batch, built once per batch from host metadata.

    Attributes:
        lengths: tokens per sample, in packing order (host integers: splitting the packed
            tokens per sample never reads the device).
    """

    lengths: tuple[int, ...]
    _device_cu: dict[torch.device, Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Varlen:
        """Boundaries of samples with these lengths (plain ints, never device tensors)."""
        return cls(tuple(int(n) for n in lengths))

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths, default=0)

    def cu_seqlens(self, device: torch.device | str) -> Tensor:
        """``[0, l0, l0+l1, ...]`` int32 on ``device`` (FlashAttention's format): computed on
        the host and copied once per device, then reused by every layer. The copy to a GPU
        goes from pinned memory, so it does not wait for the device either."""
        device = torch.device(device)
        cu = self._device_cu.get(device)
        if cu is None:
            host = torch.zeros(len(self.lengths) + 1, dtype=torch.int32)
            host[1:] = torch.cumsum(torch.tensor(self.lengths, dtype=torch.int32), 0)
            if device.type == "cuda":
                host = host.pin_memory()
            cu = self._device_cu[device] = host.to(device, non_blocking=True)
        return cu


AttentionFn = Callable[[Tensor, Tensor, Tensor, Varlen], Tensor]
"""``(q, k, v, seqs) -> out``, each of q, k, v, out [total_tokens, heads, head_dim]."""


def sdpa_varlen(q: Tensor, k: Tensor, v: Tensor, seqs: Varlen) -> Tensor:
    """Bidirectional softmax attention inside each packed sample (a block-diagonal mask).

    One ``scaled_dot_product_attention`` call per sample: for ~1-2K tokens on CPU this does only
    the sum of s^2 work (a block mask over the whole pack does total^2) and each sample sees
    exactly the same kernel shapes whatever its batch-mates. The split uses the host lengths.

    Args:
        q, k, v: [total_tokens, heads, head_dim].
        seqs: the samples' boundaries.

    Returns:
        [total_tokens, heads, head_dim], samples in the input order.
    """
    outs = []
    for qs, ks, vs in zip(*(torch.split(t, seqs.lengths) for t in (q, k, v)), strict=True):
        # [len, heads, dim] -> [heads, len, dim] for SDPA, and back.
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)
        )
        outs.append(out.transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs)


VarlenKernel = Callable[..., Tensor]
"""``(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None) -> out``: attention within
each sample of the pack in one launch (bidirectional, or causal for the LLM); q, k, v and out
[total_tokens, heads, head_dim], k and v possibly with fewer heads (grouped-query attention);
``scale`` None: 1/sqrt(head_dim)."""


def _flash_attn_kernel() -> VarlenKernel:
    """flash-attn 2.x's ``flash_attn_varlen_func`` (signature read against 2.7/2.8; grouped-query
    heads native)."""
    from flash_attn import flash_attn_varlen_func

    def flash_attn_varlen(
        q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, *, causal=False, scale=None
    ) -> Tensor:
        return flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, 0.0, softmax_scale=scale, causal=causal
        )

    return flash_attn_varlen


def _torch_kernel() -> VarlenKernel:
    """PyTorch's own FlashAttention-2 varlen op (``torch.nn.attention.varlen``, torch >= 2.9),
    so GPUs without flash-attn installed get one too. Its keywords changed between releases
    (2.9: ``is_causal``; 2.13: ``window_size``, ``scale``, ``enable_gqa``): the ones this torch
    lacks are done around it (grouped-query heads repeated, the query pre-scaled)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal_kw = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal_kw = {"is_causal": True}
    else:
        raise ImportError("this torch's varlen_attn has no causal mode")

    def torch_varlen_attn(
        q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, *, causal=False, scale=None
    ) -> Tensor:
        kwargs = dict(causal_kw) if causal else {}
        if scale is not None:
            if "scale" in params:
                kwargs["scale"] = scale
            else:  # the kernel multiplies by 1/sqrt(d)
                q = q * (scale * q.shape[-1] ** 0.5)
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)

    return torch_varlen_attn


@functools.cache
def gpu_varlen_kernel() -> VarlenKernel | None:
    """The one-launch varlen kernel of this machine: flash-attn's where installed, else
    PyTorch's; None without CUDA. A kernel that fails to import counts as absent: it must never
    stop a run that per-sample SDPA can serve."""
    if not torch.cuda.is_available():
        return None
    for load in (_flash_attn_kernel, _torch_kernel):
        try:
            return load()
        except Exception:
            continue
    return None


def kernel_serves(q: Tensor) -> bool:
    """FlashAttention 2's limits: CUDA, fp16/bf16, head dim a multiple of 8 up to 256."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, seqs: Varlen) -> Tensor:
    """The default attention core: one varlen kernel launch for the whole pack
    (:func:`gpu_varlen_kernel`, boundaries from the device copy of ``cu_seqlens``) where one
    exists and the tensors suit it, per-sample SDPA (:func:`sdpa_varlen`) otherwise. Same
    arguments, same result.
    """
    kernel = gpu_varlen_kernel()
    if kernel is None or not kernel_serves(q):
        return sdpa_varlen(q, k, v, seqs)
    return kernel(q, k, v, seqs.cu_seqlens(q.device), seqs.max_seqlen)


def pad_packed(x: Tensor, seqs: Varlen) -> Tensor:
    """[total, ...] packed samples -> [batch, max_len, ...], zero-padded at the end of each sample.

    For per-sample convolutions: zero padding past a sample's end is exactly what a 'same'-padded
    convolution of that sample alone sees, so outputs stay batch-composition invariant.
    """
    return nn.utils.rnn.pad_sequence(list(torch.split(x, seqs.lengths)), batch_first=True)


def unpad(x: Tensor, seqs: Varlen) -> Tensor:
    """Inverse of :func:`pad_packed`: [batch, max_len, ...] -> [total, ...]."""
    return torch.cat([x[i, :n] for i, n in enumerate(seqs.lengths)])


def sincos_1d(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal embeddings (Vaswani et al. 2017) of float positions: [n] -> [n, dim], fp32.

    First half sin, second half cos, frequencies ``1 / 10000^(i / (dim/2))``; computed on the fly,
    so there is no maximum length or resolution.
    """
    if dim % 2:
        raise ValueError(f"sin-cos embedding width must be even, got {dim}")
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=positions.device) / half
    )
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_2d(height: int, width: int, dim: int, *, device: torch.device | None = None) -> Tensor:
    """2D sin-cos positions of a ``height x width`` patch grid, row-major: [height*width, dim].

    As in MAE: half of the channels encode the row, half the column.
    """
    if dim % 4:
        raise ValueError(f"2D sin-cos embedding width must be a multiple of 4, got {dim}")
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return torch.cat([sincos_1d(rows, dim // 2), sincos_1d(cols, dim // 2)], dim=1)


class TokenMixer:
    """The ops through which the tokens of one sample mix, for tokens held whole on this rank.

    An encoder builds (or is given) one mixer and hands it to all its layers. This default computes
    locally; :class:`~omni_trainer.models.ulysses.UlyssesMixer` overrides the three methods to
    run one sample sharded along the sequence across ranks.

    The mixer also runs the encoder's blocks (:meth:`run_blocks`), so activation recompute
    (``recompute``, ``train.recompute``) is one setting for every layer: ``selective`` recomputes
    the attention core in the backward, ``full`` whole blocks (the first ``layers``).

    Args:
        core: the attention kernel over full samples (:func:`varlen_attention`: a one-launch
            varlen kernel on GPUs, per-sample SDPA otherwise).
    """

    def __init__(self, core: AttentionFn = varlen_attention) -> None:
        self.core = core
        self.recompute = Recompute()

    def attention(self, q: Tensor, k: Tensor, v: Tensor, seqs: Varlen) -> Tensor:
        """Attention within each sample: q, k, v [tokens, heads, head_dim] -> same shape."""
        return self.core_attention(q, k, v, seqs)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, seqs: Varlen) -> Tensor:
        """The attention core on whole samples; under selective recompute it keeps only its
        inputs and reruns in the backward (the scores / softmax are never kept)."""
        if self.recompute.mode == "selective" and torch.is_grad_enabled():
            return checkpoint(self.core, q, k, v, seqs, use_reentrant=False)
        return self.core(q, k, v, seqs)

    def run_blocks(self, blocks: nn.ModuleList, x: Tensor, seqs: Varlen) -> Tensor:
        """``x`` through ``blocks`` in order. Under full recompute the first ``layers`` blocks
        keep only their input and rerun in the backward, with the mixer as it was in the forward
        (a sharded sample's backward runs after its forward's :meth:`state` has been left)."""
        full = self.recompute.mode == "full" and torch.is_grad_enabled()
        count = len(blocks) if self.recompute.layers is None else self.recompute.layers
        for i, block in enumerate(blocks):
            if full and i < count:
                x = checkpoint(self._rerun, block, self.state(), x, seqs, use_reentrant=False)
            else:
                x = block(x, seqs)
        return x

    def _rerun(self, block: nn.Module, state: Any, x: Tensor, seqs: Varlen) -> Tensor:
        with self.restored(state):
            return block(x, seqs)

    def state(self) -> Any:
        """What the mixer's calls depend on beyond their arguments (here: nothing)."""
        return None

    @contextmanager
    def restored(self, state: Any) -> Iterator[None]:
        """Within the block, the mixer in ``state`` (from :meth:`state`)."""
        yield

    def gather_sequence(self, x: Tensor, seqs: Varlen) -> tuple[Tensor, Varlen]:
        """The whole samples that ``x`` holds tokens of, for an op that needs neighbours.

        Args:
            x: [tokens, ...] this rank's tokens.
            seqs: their sample boundaries.

        Returns:
            ``(x_full, seqs_full)``: the full samples and their boundaries (here: unchanged).
        """
        return x, seqs

    def scatter_sequence(self, x_full: Tensor) -> Tensor:
        """Inverse of :meth:`gather_sequence` on its result's layout: back to this rank's tokens."""
        return x_full


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the activation of OpenAI's CLIP towers."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


def tanh_gelu() -> nn.Module:
    """GELU's tanh approximation (SigLIP's ``gelu_pytorch_tanh``)."""
    return nn.GELU(approximate="tanh")


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "quick_gelu": QuickGELU,
    "gelu_pytorch_tanh": tanh_gelu,
    "gelu_new": tanh_gelu,
    "silu": nn.SiLU,
}
"""Hugging Face ``hidden_act`` names -> the module computing it."""


class MultiHeadSelfAttention(nn.Module):
    """QKV projection, the mixer's attention, output projection."""

    def __init__(
        self, hidden_size: int, num_heads: int, *, mixer: TokenMixer | None = None
    ) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.mixer = mixer if mixer is not None else TokenMixer()
        """The only cross-token op here; shared with the encoder's other layers."""

    def forward(self, x: Tensor, seqs: Varlen) -> Tensor:
        """[total, hidden] -> [total, hidden], attending within each sample."""
        total = x.shape[0]
        q, k, v = self.qkv(x).view(total, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.mixer.attention(q, k, v, seqs)
        return self.proj(out.reshape(total, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Linear, activation, Linear (GELU in the ViT, SiLU/Swish in Conformer feed-forwards)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: Callable[[], nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.act = activation()
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        """Per-token: no mixing across tokens."""
        return self.fc2(self.act(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int,
        *,
        mixer: TokenMixer | None = None,
        eps: float = 1e-5,
        activation: Callable[[], nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.attn = MultiHeadSelfAttention(hidden_size, num_heads, mixer=mixer)
        self.mlp_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = MLP(hidden_size, ffn_hidden_size, activation=activation)

    def forward(self, x: Tensor, seqs: Varlen) -> Tensor:
        """[total, hidden] -> [total, hidden]."""
        x = x + self.attn(self.attn_norm(x), seqs)
        return x + self.mlp(self.mlp_norm(x))
