"""CPU calibration helpers: thread/oversubscription model, profile build, overhead fit, alpha-beta
fit, and the simulator on a single CPU rank against the closed form (a plain sum of its ops)."""

from __future__ import annotations

import pytest

from omni_trainer.costs.devices import Link, all_reduce_time
from omni_trainer.costs.step_costs import Layout, encoder_mb_cost, llm_op_costs
from omni_trainer.data.config import LengthDistribution
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import AudioEncoderConfig
from omni_trainer.planner.calibration import (
    SMALL_COLLECTIVES_PER_STEP,
    CpuOverheads,
    CpuRates,
    concurrent_processes,
    cpu_rank_profile,
    fit_all_reduce_link,
    fit_overheads,
    oversubscription,
    predicted_step_time,
    threads_per_rank,
)
from omni_trainer.planner.simulate import predict
from omni_trainer.planner.workloads import SourceShape, Workload, sample_sequences

LINK = Link(name="gloo", alpha_s=1e-4, bandwidth=1e9)
ONE_THREAD = CpuRates(threads=1, processes=2, gemm_flops=80e9, attention_flops=20e9)
OVER = CpuOverheads(per_microbatch_s=0.01, per_step_s=0.05)
MODEL = ModelConfig(
    llm=LLMConfig(preset="tiny"),
    encoders=EncodersConfig(audio=AudioEncoderConfig(preset="conformer-tiny")),
)


def _audio_text() -> Workload:
    """Audio clips of 25..200 positions and texts of 10..400 at 1:1 on one rank."""
    speech = LengthDistribution(mean=60, sigma=0.6, min=25, max=200)
    text = LengthDistribution(mean=100, sigma=1.0, min=10, max=400)
    return Workload(
        name="at", model=MODEL, world_size=1, global_batch=8, seq_length=256,
        shares=(("audio", 0.5), ("text", 0.5)),
        sources=(SourceShape(name="a", modality="audio", length=speech),
                 SourceShape(name="t", modality="text", length=text)),
    )  # fmt: skip


def test_threads_processes_and_oversubscription_on_two_cores() -> None:
    assert [threads_per_rank(w, 2) for w in (1, 2, 4)] == [2, 1, 1]
    assert [concurrent_processes(w, 2) for w in (1, 2, 4)] == [1, 2, 2]
    assert [oversubscription(w, 2) for w in (1, 2, 4)] == [1.0, 1.0, 2.0]
    assert oversubscription(4, 8) == 1.0 and concurrent_processes(4, 8) == 4


def test_rank_profile_divides_by_oversubscription() -> None:
    dev2 = cpu_rank_profile(ONE_THREAD, world_size=2, cores=2, link=LINK, memory_bytes=1e9)
    dev4 = cpu_rank_profile(ONE_THREAD, world_size=4, cores=2, link=LINK, memory_bytes=1e9)
    assert dev2.peak_flops == 80e9 and dev4.peak_flops == 40e9
    assert dev4.efficiency.gemm_efficiency(128) == 1.0
    assert dev4.efficiency.attention == pytest.approx(20e9 / 80e9)
    assert dev4.intra.alpha_s == 1e-4 and dev4.intra.bandwidth == 1e9 and dev4.grad_bytes == 4
    # 1 GFLOP of GEMM at 40 GFLOP/s: 25 ms; of attention at a quarter of that: 100 ms.
    assert dev4.compute_time(1e9, "gemm", width=128) == pytest.approx(0.025)
    assert dev4.compute_time(1e9, "attention") == pytest.approx(0.1)
    two = CpuRates(threads=2, processes=1, gemm_flops=150e9, attention_flops=30e9)
    with pytest.raises(ValueError, match="threads"):  # torchrun's processes run 1 thread
        cpu_rank_profile(two, world_size=2, cores=2, link=LINK, memory_bytes=1e9)
    # a lone process runs what OMP_NUM_THREADS says, alone on the machine
    lone = cpu_rank_profile(ONE_THREAD, world_size=1, cores=2, link=LINK, memory_bytes=1e9)
    assert lone.peak_flops == 80e9


def test_overheads_fit_and_prediction_hand_computed() -> None:
    over = fit_overheads(measured_s=0.30, simulated_s=0.10, per_step_s=0.04, microbatches=4)
    assert over.per_step_s == 0.04 and over.per_microbatch_s == pytest.approx(0.04)
    assert fit_overheads(measured_s=0.1, simulated_s=0.2, per_step_s=0.0, microbatches=1) == (
        CpuOverheads(per_microbatch_s=0.0, per_step_s=0.0)
    )
    # world 1: no collectives, no stretch: 0.1 + 0.05 + 4 x 0.01.
    assert predicted_step_time(
        0.1, OVER, world_size=1, cores=2, microbatches_per_rank=4, link=LINK
    ) == pytest.approx(0.19)
    # world 4 on 2 cores: overheads doubled, 3 small all-reduces of 2 x 3 latencies each.
    small = SMALL_COLLECTIVES_PER_STEP * 6 * 1e-4
    assert small == pytest.approx(
        SMALL_COLLECTIVES_PER_STEP * all_reduce_time(8, 4, LINK), rel=1e-4
    )
    assert predicted_step_time(
        0.1, OVER, world_size=4, cores=2, microbatches_per_rank=1, link=LINK
    ) == pytest.approx(0.1 + 2 * 0.06 + small, rel=1e-4)


def test_alpha_beta_fit_recovers_ring_model() -> None:
    link = Link(name="x", alpha_s=3e-5, bandwidth=2e9)
    sizes = [8, 4e3, 2.5e5, 1e6, 4e6]
    times = [all_reduce_time(s, 2, link) for s in sizes]
    alpha, bw = fit_all_reduce_link(sizes, times, n=2)
    assert alpha == pytest.approx(3e-5, rel=1e-6)
    assert bw == pytest.approx(2e9, rel=1e-6)


def test_single_rank_step_is_the_sum_of_its_ops() -> None:
    """pp = 1, dp = 1: no overlap is possible, the step is every op's time added up."""
    work = _audio_text()
    dev = cpu_rank_profile(
        CpuRates(threads=2, processes=1, gemm_flops=100e9, attention_flops=30e9),
        world_size=1, cores=2, link=LINK, memory_bytes=1e9,
    )  # fmt: skip
    seqs = sample_sequences(work, 8, seed=0)
    total = 0.0
    for i in range(0, 8, 2):
        mb = seqs[i : i + 2]
        (c,) = llm_op_costs(MODEL.llm, mb, Layout(micro_batch_size=2), dev)
        total += c.forward + c.backward
        audio = [g.media_tokens for s in mb for g in s.segments if g.modality == "audio"]
        if audio:
            e = encoder_mb_cost(MODEL.encoders.audio, audio, llm_hidden=MODEL.llm.hidden_size,
                                layout=Layout(micro_batch_size=2), device=dev)  # fmt: skip
            total += e.forward + e.backward
    p = predict(work, Layout(micro_batch_size=2), device=dev, seed=0)
    assert p.step_time == pytest.approx(total, rel=1e-9)


def test_bad_inputs_rejected() -> None:
    with pytest.raises(ValueError):
        fit_all_reduce_link([1.0], [1.0])
    with pytest.raises(ValueError):
        CpuRates(threads=0, processes=1, gemm_flops=1, attention_flops=1)
    with pytest.raises(ValueError):
        CpuOverheads(per_microbatch_s=-1, per_step_s=0)
    with pytest.raises(ValueError):
        fit_overheads(measured_s=1, simulated_s=0, per_step_s=0, microbatches=0)
