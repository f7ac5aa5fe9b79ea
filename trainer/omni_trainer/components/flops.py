"""Model FLOPs and MFU accounting, shared by the encoders and the LLM (pure Python, no torch).

Convention (PAPER.md, as VeOmni's ``count_flops`` does it): model FLOPs = 2 x matmul params x tokens
per forward, plus the attention score/value matmuls (QK^T and AV, 2 x 2 x s^2 x h per layer per
sequence), encoders included; training = 3 x forward (backward costs twice the forward). Samples
never attend to each other, so the attention term is a sum of per-sequence squares.

The attention term counts the full s^2 square by default, for encoders (bidirectional) and the
causal LLM alike, as VeOmni and Megatron-LM's ``num_floating_point_operations`` do; ``causal=True``
halves it for FlashAttention-style "useful work" accounting. Norms, biases, activations, softmax and
embedding lookups are not counted (they are not matmuls and are well under 1%).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

# Dense (no sparsity) BF16 tensor-core peak per device, from the public NVIDIA datasheets:
# H100 SXM / H200 / H800 SXM: 1,979 TFLOP/s "with sparsity" -> 989 dense (H100 and H200 datasheets);
# H100 PCIe: 1,513 with sparsity -> 756 dense; A100 (SXM and PCIe): 312 dense (A100 datasheet).
DEVICE_PEAK_FLOPS: Mapping[str, float] = MappingProxyType(
    {
        "H100 SXM": 989e12,
        "H100 PCIe": 756e12,
        "H200": 989e12,
        "H800": 989e12,
        "A100": 312e12,
    }
)

# Substrings of a lower-cased ``torch.cuda.get_device_name()`` -> DEVICE_PEAK_FLOPS key; first match
# wins, so the more specific names come first ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3").
_DEVICE_NAME_PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h200",), "H200"),
    (("h100", "pcie"), "H100 PCIe"),
    (("h100",), "H100 SXM"),
    (("h800",), "H800"),
    (("a100",), "A100"),
)


def matmul_flops(m: int, n: int, k: int) -> float:
    """FLOPs of an [m, k] x [k, n] matmul (one multiply and one add per MAC)."""
    return 2.0 * m * n * k


def attention_flops(
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    seq_lengths: Sequence[int],
    causal: bool = False,
) -> float:
    """Forward FLOPs of the QK^T and AV matmuls, which grow with the square of each sequence.

    Args:
        num_layers: attention layers.
        num_heads: query heads (GQA broadcasts K/V heads: the work follows the query heads).
        head_dim: channels per head.
        seq_lengths: length of each independent sequence (samples never attend to each other).
        causal: count only the lower triangle (half); False counts the full square, as VeOmni does.

    Returns:
        ``num_layers * 2 matmuls * 2 * s^2 * heads * head_dim`` summed over sequences.
    """
    square_sum = sum(s * s for s in seq_lengths)
    factor = 0.5 if causal else 1.0
    return 4.0 * num_layers * num_heads * head_dim * square_sum * factor


def transformer_matmul_params(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_heads: int,
    num_query_groups: int | None = None,
    gated_mlp: bool = False,
    vocab_size: int = 0,
) -> int:
    """Weights in a matmul for every token (the ``N`` of 6NT): no norms, biases or embeddings.

    ``vocab_size`` adds the LM head (``hidden x vocab``); the input embedding is a lookup.
    """
    head_dim = hidden_size // num_heads
    groups = num_heads if num_query_groups is None else num_query_groups
    attn = 2 * hidden_size * hidden_size + 2 * hidden_size * groups * head_dim  # q, o + k, v
    mlp = (3 if gated_mlp else 2) * hidden_size * ffn_hidden_size
    return num_layers * (attn + mlp) + hidden_size * vocab_size


def transformer_flops(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_heads: int,
    num_query_groups: int | None = None,
    gated_mlp: bool = False,
    vocab_size: int = 0,
    seq_lengths: Sequence[int],
    causal: bool = False,
) -> float:
    """Forward FLOPs of a transformer over a batch of independent sequences.

    Args:
        num_layers: transformer layers.
        hidden_size: model width (``num_heads * head_dim``).
        ffn_hidden_size: MLP inner width (per branch for a gated MLP).
        num_heads: query heads.
        num_query_groups: K/V heads for GQA/MQA; None means plain multi-head attention.
        gated_mlp: SwiGLU-style MLP with three ``hidden x ffn`` matrices instead of two.
        vocab_size: adds the LM head over every token; 0 for encoders.
        seq_lengths: tokens of each sequence.
        causal: see :func:`attention_flops`; default counts the full square.

    Returns:
        ``2 * matmul params * tokens + attention`` (multiply by 3 for training, see
        :func:`training_flops`).
    """
    params = transformer_matmul_params(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_heads=num_heads,
        num_query_groups=num_query_groups,
        gated_mlp=gated_mlp,
        vocab_size=vocab_size,
    )
    tokens = sum(seq_lengths)
    attention = attention_flops(
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=hidden_size // num_heads,
        seq_lengths=seq_lengths,
        causal=causal,
    )
    return 2.0 * params * tokens + attention


def training_flops(forward_flops: float) -> float:
    """Forward + backward: the backward computes input and weight gradients, twice the forward.

    Activation recomputation is not counted, so MFU stays comparable across AC settings.
    """
    return 3.0 * forward_flops


def mfu(achieved_flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation as a fraction (0.38 means 38%) of the device peak."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be positive, got {peak_flops_per_s}")
    return achieved_flops_per_s / peak_flops_per_s


def detect_peak_flops(
    device_name: str | None, *, override: float | None = None
) -> tuple[float, str]:
    """The per-device peak that MFU divides by, and where the figure came from (logged with MFU).

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()``; None on CPU.
        override: a configured or measured figure (FLOP/s); wins over the datasheet table. On CPU
            there is no datasheet figure: pass the result of :func:`measure_peak_flops`.

    Returns:
        ``(flops_per_s, source)`` with source ``"override"`` or ``"datasheet:<table key>"``.

    Raises:
        ValueError: the device is not in :data:`DEVICE_PEAK_FLOPS` and no override was given.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOPs override must be positive, got {override}")
        return float(override), "override"
    name = (device_name or "").lower()
    for substrings, key in _DEVICE_NAME_PATTERNS:
        if all(s in name for s in substrings):
            return DEVICE_PEAK_FLOPS[key], f"datasheet:{key}"
    raise ValueError(
        f"no datasheet peak FLOPs for device {device_name!r} "
        f"(known: {', '.join(DEVICE_PEAK_FLOPS)}); pass a configured or measured figure as override"
    )


def measure_peak_flops(
    run_matmul: Callable[[], object],
    *,
    flops_per_call: float,
    iters: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Achievable FLOP/s of a device without a datasheet figure (CPU), from the fastest timed call.

    Args:
        run_matmul: runs one matmul to completion (the caller synchronizes on accelerators), e.g.
            ``lambda: a @ b`` for fp32 [n, n] tensors.
        flops_per_call: FLOPs of one call, e.g. ``matmul_flops(n, n, n)``.
        iters: timed calls; the fastest one is kept (least disturbed by other processes).
        warmup: untimed calls first (allocator, thread pool start-up).
        clock: seconds, monotonic; injectable for tests.

    Returns:
        FLOP/s of the fastest call.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        run_matmul()
    best = float("inf")
    for _ in range(iters):
        start = clock()
        run_matmul()
        best = min(best, clock() - start)
    if best <= 0:
        raise ValueError("the timed matmul took no measurable time; use a larger matmul")
    return flops_per_call / best
