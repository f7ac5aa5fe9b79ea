"""megatron-core's GPTModel as our backbone: packed samples never see each other, and the LLM
path builds no dense attention mask."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omni_trainer.models.batch import DeviceBatch, to_device_batch
from omni_trainer.models.config import LLMConfig
from omni_trainer.models.llm import build_gpt, transformer_engine_usable
from omni_trainer.models.packed import pack_boundaries, sample_lengths

BACKENDS = [
    "local",  # PackedAttention: per-sample SDPA (CPU and GPU)
    "context_parallel",  # ContextParallelAttention (one CP rank here, queries in blocks of 7)
    pytest.param(
        "te",
        marks=pytest.mark.skipif(not transformer_engine_usable(), reason="needs CUDA + TE"),
    ),
]


def test_boundaries_are_every_sample_and_each_padding_run() -> None:
    seg = np.array([[0, 0, 1, 1, 1, -1], [0, 0, 0, -1, -1, -1]])
    assert sample_lengths(seg) == [2, 3, 1, 3, 3]
    p = pack_boundaries(seg, torch.device("cpu"))
    assert p.qkv_format == "thd" and p.seqlens == (2, 3, 1, 3, 3)
    assert p.cu_seqlens_q.tolist() == [0, 2, 5, 6, 9, 12] and p.cu_seqlens_q.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 3


def _micro_batch(rows: list[list[np.ndarray]], s: int) -> SimpleNamespace:
    """A collated micro-batch (the packer's layout) of the given samples per row."""
    b = len(rows)
    tokens = np.zeros((b, s), dtype=np.int64)
    segment_ids = np.full((b, s), -1, dtype=np.int32)
    position_ids = np.zeros((b, s), dtype=np.int64)
    for r, samples in enumerate(rows):
        o = 0
        for j, sample in enumerate(samples):
            n = len(sample)
            tokens[r, o : o + n], segment_ids[r, o : o + n] = sample, j
            position_ids[r, o : o + n] = np.arange(n)
            o += n
    labels = np.roll(tokens, -1, axis=1)
    loss_mask = (segment_ids >= 0).astype(np.float32)
    return SimpleNamespace(
        tokens=tokens, labels=labels, loss_mask=loss_mask, segment_ids=segment_ids,
        position_ids=position_ids, media=[],
    )  # fmt: skip


def _forward(model, batch: DeviceBatch, **kw) -> torch.Tensor:
    return model(
        input_ids=batch.tokens,
        position_ids=batch.position_ids,
        attention_mask=None,
        packed_seq_params=batch.packed_seq_params,
        **kw,
    )


def _logits(model, mb: SimpleNamespace, backend: str, device) -> torch.Tensor:
    """The model's logits of a collated micro-batch, in the order of its packed row."""
    from omni_trainer.models import context_parallel as cp

    batch = to_device_batch(mb, device, load=None)
    order = torch.arange(batch.tokens.shape[1])  # which position of the row each token holds
    if backend == "context_parallel":
        batch = cp.shard_for_context(batch, mb.segment_ids, cp=1, cp_rank=0)
        cp.set_rope_positions(model, batch.position_ids)
        order = torch.as_tensor(cp.context_token_index(mb.segment_ids, 1)[0][0])
    logits = _forward(model, batch)[0]
    out = torch.empty_like(logits)
    out[order] = logits
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_samples_equal_samples_alone(backend, single_rank, monkeypatch) -> None:
    from omni_trainer.models import context_parallel, llm

    device = torch.device("cuda" if backend == "te" else "cpu")
    if backend == "context_parallel":  # the CP build at one rank: the gather is the identity
        monkeypatch.setattr(llm, "_context_parallel_size", lambda: 2)
        monkeypatch.setattr(context_parallel, "QUERY_CHUNK", 7)  # several query blocks
    model = build_gpt(LLMConfig(preset="tiny"), max_sequence_length=64).to(device).eval()
    gen = np.random.default_rng(0)
    a, b, c = (gen.integers(0, 512, n) for n in (10, 14, 9))
    with torch.no_grad():
        packed = _logits(model, _micro_batch([[a, b], [c]], s=24), backend, device)
        assert packed.shape[0] == 48
        for start, sample in ((0, a), (10, b), (24, c)):
            alone = _logits(model, _micro_batch([[sample]], s=len(sample)), backend, device)
            torch.testing.assert_close(
                packed[start : start + len(sample)], alone, rtol=1e-5, atol=1e-5
            )
        # b attending to a (one causal sequence, no boundaries) changes b's logits
        leaky = _logits(model, _micro_batch([[np.concatenate([a, b])]], s=24), backend, device)
    assert not torch.allclose(leaky[10:24], packed[10:24], atol=1e-3)


class _SquareTensors(TorchDispatchMode):
    """Records every op output with two dimensions of a row's or the packed row's length (a
    dense mask or a score matrix over a row or the whole micro-batch)."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        super().__init__()
        self.lengths, self.found = lengths, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, torch.Tensor) and sum(d in self.lengths for d in o.shape) >= 2:
                self.found.append((str(func), tuple(o.shape)))
        return out


def test_llm_path_builds_no_dense_mask(single_rank) -> None:
    assert "attention_mask" not in {f.name for f in dataclasses.fields(DeviceBatch)}
    model = build_gpt(LLMConfig(preset="tiny"), max_sequence_length=64)
    gen = np.random.default_rng(1)
    mb = _micro_batch([[gen.integers(0, 512, n) for n in (10, 14)], [gen.integers(0, 512, 9)]], 24)
    with _SquareTensors(lengths=(24, 48)) as probe:
        batch = to_device_batch(mb, torch.device("cpu"), load=None)
        _forward(model, batch, labels=batch.labels).sum().backward()
    assert probe.found == []
    # the probe does catch the [b, 1, s, s] mask the LLM path used to build
    with _SquareTensors(lengths=(24, 48)) as probe:
        seg = torch.as_tensor(mb.segment_ids)
        _ = (seg[:, :, None] == seg[:, None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    assert probe.found


def test_gpt_shapes_follow_config(single_rank) -> None:
    cfg = LLMConfig(preset="tiny", num_layers=3)
    model = build_gpt(cfg, max_sequence_length=32)
    assert len(model.decoder.layers) == 3
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    emb = model.embedding(input_ids=tokens, position_ids=torch.arange(16).expand(2, 16))
    assert emb.shape == (16, 2, cfg.hidden_size)  # megatron is sequence-first
    out = model(input_ids=tokens, position_ids=torch.arange(16).expand(2, 16), attention_mask=None)
    assert out.shape == (2, 16, cfg.vocab_size) and torch.isfinite(out).all()


def test_megatrons_jit_fused_paths_are_off(single_rank) -> None:
    """What lets :mod:`omni_trainer.megatron_imports` leave megatron's jit fuser uncompiled."""
    config = build_gpt(LLMConfig(preset="tiny"), max_sequence_length=32).config
    assert not config.bias_dropout_fusion and not config.bias_activation_fusion
    assert not config.masked_softmax_fusion


def test_layer_spec_can_be_forced(single_rank) -> None:
    """``LLMRuntime.layer_spec``: local builds the local spec anywhere; te where it cannot run
    says so before building anything."""
    from omni_trainer.models.llm import LLMRuntime
    from omni_trainer.models.packed import PackedAttention

    local = build_gpt(
        LLMConfig(preset="tiny"), max_sequence_length=32, runtime=LLMRuntime(layer_spec="local")
    )
    assert isinstance(local.decoder.layers[0].self_attention.core_attention, PackedAttention)
    if not transformer_engine_usable():
        with pytest.raises(RuntimeError, match="needs CUDA and an importable TransformerEngine"):
            build_gpt(
                LLMConfig(preset="tiny"),
                max_sequence_length=32,
                runtime=LLMRuntime(layer_spec="te"),
            )
