"""CPU calibration helpers: thread/oversubscription model, profile build, alpha-beta fit."""

from __future__ import annotations

import pytest

from omni_trainer.planner.calibration import (
    CpuCalibration,
    cpu_rank_profile,
    fit_all_reduce_link,
    oversubscription,
    predicted_step_time,
    rank_gemm_flops,
    threads_per_rank,
)
from omni_trainer.planner.devices import all_reduce_time

CAL = CpuCalibration(
    cores=2, gemm_flops_1t=80e9, gemm_flops_all=150e9, attention_flops_1t=20e9,
    attention_flops_all=30e9, alpha_s=1e-5, bandwidth=1e9,
    overhead_per_microbatch_s=0.01, overhead_per_step_s=0.05,
)  # fmt: skip


def test_threads_and_oversubscription_on_two_cores() -> None:
    assert [threads_per_rank(w, 2) for w in (1, 2, 4)] == [2, 1, 1]
    assert [oversubscription(w, 2) for w in (1, 2, 4)] == [1.0, 1.0, 2.0]


def test_rank_rate_is_thread_rate_over_oversubscription() -> None:
    assert rank_gemm_flops(CAL, 1) == 150e9
    assert rank_gemm_flops(CAL, 2) == 80e9
    assert rank_gemm_flops(CAL, 4) == 40e9


def test_profile_uses_measured_rates_and_link() -> None:
    dev = cpu_rank_profile(CAL, 4, memory_bytes=1e9)
    assert dev.peak_flops == 40e9
    assert dev.efficiency.gemm_efficiency(128) == 1.0
    assert dev.efficiency.attention == pytest.approx(20e9 / 80e9)
    assert dev.intra.alpha_s == 1e-5 and dev.intra.bandwidth == 1e9
    # 1 GFLOP of GEMM at 40 GFLOP/s: 25 ms.
    assert dev.compute_time(1e9, "gemm", width=128) == pytest.approx(0.025)


def test_predicted_step_adds_stretched_overheads() -> None:
    # world 4 on 2 cores: (0.05 + 0.01 * 1) * 2 on top of the simulated 0.1 s.
    assert predicted_step_time(0.1, CAL, world_size=4, microbatches_per_rank=1) == pytest.approx(
        0.22
    )
    assert predicted_step_time(0.1, CAL, world_size=1, microbatches_per_rank=4) == pytest.approx(
        0.19
    )


def test_alpha_beta_fit_recovers_ring_model() -> None:
    from omni_trainer.planner.devices import Link

    link = Link(name="x", alpha_s=3e-5, bandwidth=2e9)
    sizes = [4e3, 2.5e5, 1e6, 4e6]
    times = [all_reduce_time(s, 2, link) for s in sizes]
    alpha, bw = fit_all_reduce_link(sizes, times, n=2)
    assert alpha == pytest.approx(3e-5, rel=1e-6)
    assert bw == pytest.approx(2e9, rel=1e-6)


def test_bad_inputs_rejected() -> None:
    with pytest.raises(ValueError):
        fit_all_reduce_link([1.0], [1.0])
    with pytest.raises(ValueError):
        CpuCalibration(cores=0, gemm_flops_1t=1, gemm_flops_all=1, attention_flops_1t=1,
                       attention_flops_all=1, alpha_s=0, bandwidth=1)  # fmt: skip
