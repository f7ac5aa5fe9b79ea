"""Cost models: the coefficients reproduce the FLOPs accounting they are read from."""

from __future__ import annotations

import pytest

from omni_trainer.balance import EncoderCost, cost_from_config, cost_from_llm_config
from omni_trainer.costs.flops import attention_flops
from omni_trainer.models.config import LLMConfig
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig

ENCODERS = [
    VisionEncoderConfig(preset="vit-l-14"),
    VisionEncoderConfig(preset="vit-tiny"),
    AudioEncoderConfig(preset="usm-2b"),
    AudioEncoderConfig(preset="conformer-tiny"),
]


def test_cost_formula_and_zero_length() -> None:
    cost = EncoderCost(linear=2.0, quadratic=0.5, fixed=3.0)
    assert cost(4) == 3.0 + 8.0 + 8.0
    assert cost(0) == 0.0  # no sample, no fixed overhead either
    assert cost.total([1, 4]) == cost(1) + cost(4)
    with pytest.raises(ValueError, match="linear"):
        EncoderCost(linear=-1.0, quadratic=0.0)


@pytest.mark.parametrize("encoder", ENCODERS, ids=lambda e: e.preset)
def test_encoder_cost_matches_config_flops(encoder: VisionEncoderConfig) -> None:
    cost = cost_from_config(encoder)
    for length in (1, 7, 256, 3000):
        assert cost(length) == pytest.approx(encoder.flops([length]), rel=1e-12)
    # The quadratic part is exactly the attention term.
    attention = attention_flops(
        num_layers=encoder.num_layers,
        num_heads=encoder.num_heads,
        head_dim=encoder.hidden_size // encoder.num_heads,
        seq_lengths=[1],
    )
    assert cost.quadratic == pytest.approx(attention, rel=1e-12)
    assert cost.fixed == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_llm_cost_matches_transformer_flops(causal: bool) -> None:
    from omni_trainer.costs.flops import transformer_flops

    llm = LLMConfig(preset="llama-7b")
    cost = cost_from_llm_config(llm, causal=causal)
    for length in (1, 512, 16384):
        expected = transformer_flops(
            num_layers=llm.num_layers,
            hidden_size=llm.hidden_size,
            ffn_hidden_size=llm.ffn_hidden_size,
            num_heads=llm.num_attention_heads,
            num_query_groups=llm.num_query_groups,
            gated_mlp=llm.gated_mlp,
            vocab_size=llm.vocab_size,
            seq_lengths=[length],
            causal=causal,
        )
        assert cost(length) == pytest.approx(expected, rel=1e-12)
