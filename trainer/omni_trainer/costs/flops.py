"""Model FLOPs and MFU accounting, shared by the encoders and the LLM (pure Python, no torch).

Convention (:data:`MFU_CONVENTION`, Megatron-LM's ``num_floating_point_operations``): model FLOPs =
2 x matmul params x tokens per forward, plus the attention score/value matmuls (QK^T and AV,
2 x 2 x s^2 x h per layer per sequence), encoders included; training = 3 x forward (backward costs
twice the forward). Samples never attend to each other, so the attention term is a sum of
per-sequence squares.

The causal LLM counts half of each square (only the lower triangle is computed), as Megatron-LM
does; bidirectional encoders count the full square. Norms, biases, activations, softmax and
embedding lookups are not counted (they are not matmuls and are well under 1%).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

MFU_CONVENTION = "megatron-lm"
"""How model FLOPs are counted (reported beside every MFU figure): Megatron-LM's
``num_floating_point_operations`` for the LLM (causal attention halved), full squares for the
bidirectional encoders."""

# Dense (no sparsity) peak per device from the public NVIDIA datasheets, (bf16, fp32) in FLOP/s.
# bf16: tensor cores; the datasheets print "with sparsity" figures, halved here. fp32: the plain
# FP32 figure (CUDA cores), what fp32 matmuls run at unless TF32 is enabled.
#   H100 SXM / H800 SXM / H200 SXM (and GH200: the same tensor cores): 1,979 sparse -> 989; 67.
#   H100 PCIe / H800 PCIe: 1,513 sparse -> 756; 51.    H100 NVL / H200 NVL: 1,671 -> 835; 60.
#   H20: 296 sparse -> 148; 44.    A100 40GB and 80GB (SXM and PCIe): 624 sparse -> 312; 19.5.
#   B200 (HGX B200, per GPU): 4.5 PF sparse -> 2,250; 75.    L40S: 733 sparse -> 362; 91.6.
DEVICE_PEAKS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        key: MappingProxyType({"bf16": bf16 * 1e12, "fp32": fp32 * 1e12})
        for key, bf16, fp32 in (
            ("H100 SXM", 989, 67),
            ("H100 PCIe", 756, 51),
            ("H100 NVL", 835, 60),
            ("H200 SXM", 989, 67),
            ("H200 NVL", 835, 60),
            ("H800 SXM", 989, 67),
            ("H800 PCIe", 756, 51),
            ("H20", 148, 44),
            ("A100 40GB", 312, 19.5),
            ("A100 80GB", 312, 19.5),
            ("B200", 2250, 75),
            ("L40S", 362, 91.6),
        )
    }
)
DEVICE_PEAK_FLOPS: Mapping[str, float] = MappingProxyType(
    {key: peaks["bf16"] for key, peaks in DEVICE_PEAKS.items()}
)
"""The bf16 column of :data:`DEVICE_PEAKS` (what the planner models: it plans bf16 training)."""

# Substrings of a lower-cased ``torch.cuda.get_device_name()`` -> table key; first match wins, so
# the more specific names come first ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3", "H200"
# before "H20").
_DEVICE_NAME_PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h200", "nvl"), "H200 NVL"),
    (("h200",), "H200 SXM"),
    (("gh200",), "H200 SXM"),
    (("h100", "nvl"), "H100 NVL"),
    (("h100", "pcie"), "H100 PCIe"),
    (("h100",), "H100 SXM"),
    (("h800", "pcie"), "H800 PCIe"),
    (("h800",), "H800 SXM"),
    (("h20",), "H20"),
    (("a100", "80gb"), "A100 80GB"),
    (("a100",), "A100 40GB"),
    (("b200",), "B200"),
    (("l40s",), "L40S"),
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
        causal: count only the lower triangle (half), as Megatron-LM counts causal attention;
            False counts the full square (bidirectional encoders).

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
        causal: see :func:`attention_flops`; the LLM passes True (``LLMConfig.flops``).

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
    device_name: str | None, *, dtype: str = "bf16", override: float | None = None
) -> tuple[float, str] | None:
    """The per-device peak that MFU divides by, and where the figure came from (logged with MFU).

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()``; None on CPU.
        dtype: ``"bf16"`` or ``"fp32"``: the precision the job computes in.
        override: a configured figure (FLOP/s); wins over the datasheet table.

    Returns:
        ``(flops_per_s, source)`` with source ``"override"`` or ``"datasheet:<key> <dtype>"``;
        None for a device the table does not know (the caller measures a matmul instead).
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOPs override must be positive, got {override}")
        return float(override), "override"
    name = (device_name or "").lower()
    for substrings, key in _DEVICE_NAME_PATTERNS:
        if all(s in name for s in substrings):
            return DEVICE_PEAKS[key][dtype], f"datasheet:{key} {dtype}"
    return None


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
