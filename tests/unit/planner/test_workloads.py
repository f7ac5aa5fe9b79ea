"""The planner's workload sampler honours the manifest: lengthScale, text chunking, the mixture
(image, audio, text) and its schedule; audio is sampled and costed like images."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from omni_trainer.config import load_manifest
from omni_trainer.costs.devices import cpu_profile
from omni_trainer.costs.step_costs import Layout, encoder_mb_cost
from omni_trainer.data.config import LengthDistribution
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import AudioEncoderConfig
from omni_trainer.planner.simulate import encoder_flops_share, predict
from omni_trainer.planner.workloads import (
    SourceShape,
    Workload,
    modality_token_shares,
    sample_sequences,
    workload_from_config,
)

EXAMPLES = Path(__file__).parents[3] / "examples"
AUDIO = AudioEncoderConfig(preset="conformer-tiny")
MODEL = ModelConfig(llm=LLMConfig(preset="tiny"), encoders=EncodersConfig(audio=AUDIO))


def _fixed(name: str, modality: str, mean: int, scale: float = 1.0) -> SourceShape:
    """A source whose every sample is ``round(mean * scale)`` tokens long (sigma 0)."""
    dist = LengthDistribution(mean=mean, sigma=0.0, min=1, max=1 << 20)
    return SourceShape(name=name, modality=modality, length=dist, scale=scale)


def _audio_text(audio: float, *, text_mean: int = 40, seq: int = 256) -> Workload:
    return Workload(
        name="at",
        model=MODEL,
        world_size=1,
        global_batch=8,
        seq_length=seq,
        shares=(("audio", audio), ("text", 1 - audio)),
        sources=(_fixed("speech", "audio", 1000, scale=0.05), _fixed("txt", "text", text_mean)),
    )


def test_length_scale_and_media_geometry_of_audio() -> None:
    # 1000 x 0.05 = 50 positions: 2 + (50 - round(0.85 * 50)) = 8 text, 42 audio frames / 4.
    seqs = sample_sequences(_audio_text(1.0), 20)
    audio = [g for s in seqs for g in s.segments]
    assert audio and all(g.modality == "audio" for g in audio)
    assert {(g.length, g.media_tokens) for g in audio} == {(50, 42)}
    assert all(s.used == 250 for s in seqs)  # five 50-token samples fill 256 best


def test_long_texts_are_cut_into_sequence_chunks() -> None:
    # 600-token texts into 256-long sequences: chunks 256, 256, 88, as split_text cuts them.
    # A packing buffer of 2 (data.packBuffer) lets the 88-token tails out as they come: two
    # of them share a sequence.
    work = replace(_audio_text(0.0, text_mean=600), pack_buffer=2)
    seqs = sample_sequences(work, 60)
    lengths = sorted({g.length for s in seqs for g in s.segments})
    assert lengths == [88, 256]
    full = sum(1 for s in seqs for g in s.segments if g.length == 256)
    short = sum(1 for s in seqs for g in s.segments if g.length == 88)
    assert abs(full - 2 * short) <= 2  # two full chunks per 88-token tail, but the buffered
    # With the default buffer of 64 the full chunks go first, the tails wait in the buffer.
    assert {g.length for s in sample_sequences(_audio_text(0.0, text_mean=600), 30)
            for g in s.segments} == {256}  # fmt: skip


@pytest.mark.parametrize("audio", [0.2, 0.5, 0.8])
def test_sampler_realises_the_audio_share(audio: float) -> None:
    shares = modality_token_shares(sample_sequences(_audio_text(audio), 300, seed=3))
    assert shares["audio"] == pytest.approx(audio, abs=0.03)
    assert shares["audio"] + shares["text"] == pytest.approx(1.0)


def test_audio_encoder_cost_hand_computed() -> None:
    dev = cpu_profile(1e9, attention_efficiency=0.5)
    h, f, k, heads, layers = AUDIO.hidden_size, AUDIO.ffn_hidden_size, 15, AUDIO.num_heads, 2
    n, llm_h = 42, MODEL.llm.hidden_size
    attn = 4 * heads * (h // heads) * n * n * layers
    gemm = (
        2 * 3 * AUDIO.n_mels * h * 2 * n  # conv1 at twice the output rate
        + 2 * 3 * h * h * n  # conv2
        + 2 * layers * (4 * h * f + 4 * h * h + 3 * h * h + h * k) * n
        + 2 * n * llm_h * (h + llm_h)  # projector
    )
    assert AUDIO.num_layers == layers and AUDIO.conv_kernel_size == k
    c = encoder_mb_cost(AUDIO, [n], llm_hidden=llm_h, layout=Layout(), device=dev)
    assert c.forward == pytest.approx(gemm / 1e9 + attn / 0.5e9)
    assert c.backward == pytest.approx(2 * c.forward)
    assert c.output_bytes == n * llm_h * 2


def test_stage0_receives_its_sequence_shard_with_sp_and_every_token_without() -> None:
    """Send-then-reshard: with sequence parallelism each of stage 0's TP ranks receives only
    its shard of the projected outputs; without it each receives them all."""
    dev, n, llm_h = cpu_profile(1e9), 64, MODEL.llm.hidden_size
    whole = n * llm_h * 2
    sp = encoder_mb_cost(AUDIO, [n], llm_hidden=llm_h, layout=Layout(tp=4), device=dev)
    no_sp = encoder_mb_cost(
        AUDIO, [n], llm_hidden=llm_h, layout=Layout(tp=4, sequence_parallel=False), device=dev
    )
    assert (sp.output_bytes, no_sp.output_bytes) == (whole / 4, whole)


def test_audio_work_enters_the_prediction() -> None:
    dev = cpu_profile(50e9)
    low, high = _audio_text(0.2), _audio_text(0.8)
    assert 0 < encoder_flops_share(low) < encoder_flops_share(high)
    p = predict(high, Layout(micro_batch_size=2), device=dev)
    assert p.step_time > 0 and not p.oom


def test_manifest_mixture_schedule_and_length_scale() -> None:
    cfg = load_manifest(EXAMPLES / "tiny-cpu.yaml").spec.trainer
    early = workload_from_config(cfg, world_size=1, tokens=(0, 40960))
    assert dict(early.shares) == pytest.approx({"image": 0.5, "audio": 0.0, "text": 0.5})
    scales = {s.name: s.scale for s in early.sources}
    assert scales == {"openimages": 0.02, "refcocog": 0.02, "librispeech": 0.2, "longtext": 0.02}
    # Whole run, 150 x 8 x 256 = 307200 tokens: 1:1 up to 100K, a ramp to 13:74:13 at 250K,
    # then constant. Audio: (0.37 x 150K + 0.74 x 57.2K) / 307.2K = 0.3184.
    whole = workload_from_config(cfg, world_size=1)
    assert dict(whole.shares)["audio"] == pytest.approx(0.3184, abs=2e-3)
    seqs = sample_sequences(whole, 400, seed=2)
    got = modality_token_shares(seqs)
    assert got["audio"] == pytest.approx(0.3184, abs=0.04)
    # lengthScale 0.02 keeps image samples far below the 256 positions (unscaled they would be
    # clipped to the whole sequence): OpenImages 3800 x 0.02 = 76 on average.
    image = [g.length for s in seqs for g in s.segments if g.modality == "image"]
    assert 30 < sum(image) / len(image) < 110


def test_video_and_missing_encoders_are_rejected() -> None:
    with pytest.raises(ValueError, match="no encoder"):
        Workload(name="v", model=MODEL, world_size=1, global_batch=1, seq_length=64,
                 shares=(("video", 1.0),))  # fmt: skip
    with pytest.raises(ValueError, match="no encoder"):
        Workload(name="i", model=MODEL, world_size=1, global_batch=1, seq_length=64,
                 shares=(("image", 1.0),))  # fmt: skip
