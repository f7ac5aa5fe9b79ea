"""megatron-core's GPTModel as our backbone: packed samples never see each other."""

from __future__ import annotations

import torch

from omni_trainer.models.batch import segment_attention_mask
from omni_trainer.models.config import LLMConfig
from omni_trainer.models.llm import build_gpt


def test_segment_mask_is_causal_and_block_diagonal() -> None:
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    allowed = ~segment_attention_mask(seg)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def _losses(model, tokens: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    labels = torch.roll(tokens, -1, dims=1)
    return model(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=segment_attention_mask(segments),
        labels=labels,
    )


def test_packed_sample_equals_sample_alone(single_rank) -> None:
    model = build_gpt(LLMConfig(preset="tiny"), max_sequence_length=64).eval()
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 512, (1, 10), generator=gen)
    b = torch.randint(0, 512, (1, 14), generator=gen)
    packed = torch.cat([a, b], dim=1)
    segments = torch.tensor([[0] * 10 + [1] * 14])
    with torch.no_grad():
        packed_loss = _losses(model, packed, segments)[0, 10:-1]
        alone_loss = _losses(model, b, torch.zeros_like(b))[0, :-1]
        # Without the segment mask, b would attend to a and its losses would change.
        leaky = _losses(model, packed, torch.zeros_like(packed))[0, 10:-1]
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky, alone_loss, atol=1e-3)


def test_gpt_shapes_follow_config(single_rank) -> None:
    cfg = LLMConfig(preset="tiny", num_layers=3)
    model = build_gpt(cfg, max_sequence_length=32)
    assert len(model.decoder.layers) == 3
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    emb = model.embedding(input_ids=tokens, position_ids=torch.arange(16).expand(2, 16))
    assert emb.shape == (16, 2, cfg.hidden_size)  # megatron is sequence-first
    out = _losses(model, tokens, torch.zeros_like(tokens))
    assert out.shape == (2, 16) and torch.isfinite(out).all()
