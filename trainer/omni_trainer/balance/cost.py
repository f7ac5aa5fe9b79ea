"""How long a sample keeps a rank busy, as a function of its length: ``fixed + a*L + b*L^2``.

Balancing needs a per-sample cost that ranks can compute identically from metadata alone (the
length), before any data moves. FLOPs are that cost: matmuls grow linearly with the tokens of a
sample and attention with their square (samples never attend to each other), so one linear and one
quadratic coefficient per model describe it exactly. ``fixed`` covers per-sample overheads (kernel
launches, padding to a patch grid) that a profile may add; FLOPs alone leave it at zero.

Pure Python: the planner runs in the data loader, and the operator may size groups with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from omni_trainer.models.config import LLMConfig


class _FlopsCounter(Protocol):
    """Anything with a FLOPs count over independent sequences (the encoder configs)."""

    def flops(self, token_lengths: Sequence[int]) -> float: ...


@dataclass(frozen=True)
class EncoderCost:
    """Cost of one sequence of ``L`` tokens: ``fixed + linear * L + quadratic * L**2``.

    Named for the encoders (the loads the reordering balances first), but the LLM's cost has the
    same shape (:func:`cost_from_llm_config`). Units are whatever the coefficients carry (forward
    FLOPs for the ``cost_from_*`` helpers); only ratios between ranks matter for balancing.
    """

    linear: float
    """Cost per token (matmuls, convolutions, embeddings)."""
    quadratic: float
    """Cost per squared token (attention scores and values)."""
    fixed: float = 0.0
    """Cost per sample regardless of length; 0 for pure FLOPs."""

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "fixed"):
            if getattr(self, name) < 0:
                raise ValueError(f"EncoderCost.{name} must be >= 0, got {getattr(self, name)}")

    def __call__(self, length: int | float) -> float:
        """Cost of one sample of ``length`` tokens; a zero-length sample costs nothing."""
        if length <= 0:
            return 0.0
        return self.fixed + self.linear * length + self.quadratic * length * length

    def total(self, lengths: Sequence[int | float]) -> float:
        """Cost of independent samples (sum of their costs)."""
        return sum(self(length) for length in lengths)


def _fit(flops_of_one: float, flops_of_two: float) -> EncoderCost:
    """Coefficients of ``a*L + b*L^2`` from its values at L=1 and L=2 (exact for that shape)."""
    quadratic = (flops_of_two - 2.0 * flops_of_one) / 2.0
    return EncoderCost(linear=flops_of_one - quadratic, quadratic=quadratic)


def cost_from_config(encoder: _FlopsCounter) -> EncoderCost:
    """Forward-FLOPs cost of an encoder (``VisionEncoderConfig``, ``AudioEncoderConfig``).

    Reads the coefficients off the config's own ``flops()``, so the planner can never disagree
    with the FLOPs/MFU accounting: the quadratic part is the attention term of
    ``costs/flops.attention_flops``, the linear part everything else. Lengths are encoder
    output tokens (image patches, audio frames / 4).
    """
    return _fit(encoder.flops([1]), encoder.flops([2]))


def cost_from_llm_config(llm: LLMConfig, *, causal: bool = False) -> EncoderCost:
    """Forward-FLOPs cost of one sample in the LLM, for balancing LLM sequences.

    Args:
        llm: the backbone's shape (preset already applied by validation).
        causal: count half the attention square, as the MFU convention does; the balancer's
            default weighs the full square.

    Returns:
        The cost over the sample's LLM positions (media tokens + text), LM head included.
    """

    def flops(lengths: list[int]) -> float:
        return llm.flops(lengths, causal=causal)

    return _fit(flops([1]), flops([2]))
