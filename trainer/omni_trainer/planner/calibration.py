"""CPU calibration: a planner device for one trainer process on this machine, from measured figures.

``omni train --nproc W`` on a CPU runs W processes on the machine's cores; torchrun gives each one
OpenMP thread, a single process keeps torch's default (one thread per core). A process is a
"device" whose matmul rate is the rate measured at the model's own GEMM shapes with that many
threads, times its share of the cores when processes outnumber them. Gloo all-reduce is an
alpha-beta link fitted to timed all-reduces. Work the FLOP model does not see (Python dispatch per
micro-batch, optimizer step) is a measured overhead, stretched by the same oversubscription.

Pure helpers (no torch): the measurements come from ``bench/calibrate.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omni_trainer.planner.devices import DeviceProfile, cpu_profile

__all__ = [
    "CpuCalibration",
    "cpu_rank_profile",
    "fit_all_reduce_link",
    "oversubscription",
    "predicted_step_time",
    "rank_gemm_flops",
    "threads_per_rank",
]


@dataclass(frozen=True, kw_only=True)
class CpuCalibration:
    """Figures measured on this machine (every one by the benchmark, none chosen)."""

    cores: int
    gemm_flops_1t: float
    """FLOP/s of the model's GEMM shapes, forward and backward, on one thread."""
    gemm_flops_all: float
    """The same with ``cores`` threads (one process alone on the machine)."""
    attention_flops_1t: float
    """FLOP/s of the model's attention (unfused, as the CPU runs it) on one thread."""
    attention_flops_all: float
    alpha_s: float
    """Gloo all-reduce latency per ring step."""
    bandwidth: float
    """Gloo bytes/s per rank and direction."""
    overhead_per_microbatch_s: float = 0.0
    """CPU seconds per micro-batch the FLOP model does not count (dispatch, norms, copies)."""
    overhead_per_step_s: float = 0.0
    """CPU seconds per step outside the micro-batches (data, clip, optimizer step)."""

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        for name in ("gemm_flops_1t", "gemm_flops_all", "attention_flops_1t",
                     "attention_flops_all", "bandwidth"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.alpha_s < 0 or self.overhead_per_microbatch_s < 0 or self.overhead_per_step_s < 0:
            raise ValueError("latency and overheads must be >= 0")


def threads_per_rank(world_size: int, cores: int) -> int:
    """OpenMP threads of each process: torchrun sets 1; a lone process uses every core."""
    return cores if world_size == 1 else 1


def oversubscription(world_size: int, cores: int) -> float:
    """How much slower each process runs because runnable threads outnumber cores (>= 1)."""
    busy = world_size * threads_per_rank(world_size, cores)
    return max(1.0, busy / cores)


def rank_gemm_flops(cal: CpuCalibration, world_size: int) -> float:
    """GEMM FLOP/s one process gets: the rate at its thread count over the oversubscription."""
    t = threads_per_rank(world_size, cal.cores)
    rate = cal.gemm_flops_all if t > 1 else cal.gemm_flops_1t
    return rate / oversubscription(world_size, cal.cores)


def cpu_rank_profile(cal: CpuCalibration, world_size: int, *, memory_bytes: float) -> DeviceProfile:
    """The planner device of one process of a ``world_size``-process CPU job.

    The GEMM rate is the peak (efficiency 1: it was measured at the model's shapes); attention's
    efficiency is its measured rate over the GEMM rate at the same thread count.
    """
    t = threads_per_rank(world_size, cal.cores)
    gemm = cal.gemm_flops_all if t > 1 else cal.gemm_flops_1t
    attn = cal.attention_flops_all if t > 1 else cal.attention_flops_1t
    return cpu_profile(
        rank_gemm_flops(cal, world_size),
        memory_bytes=memory_bytes,
        cores=max(world_size, 1),  # every rank on one "node": gloo over loopback
        alpha_s=cal.alpha_s,
        bandwidth=cal.bandwidth,
        gemm_efficiency=1.0,
        attention_efficiency=min(1.0, attn / gemm),
    )


def predicted_step_time(
    simulated_s: float, cal: CpuCalibration, *, world_size: int, microbatches_per_rank: int
) -> float:
    """Simulator step time plus the measured CPU overheads, stretched by oversubscription."""
    over = cal.overhead_per_step_s + cal.overhead_per_microbatch_s * microbatches_per_rank
    return simulated_s + over * oversubscription(world_size, cal.cores)


def fit_all_reduce_link(
    sizes: Sequence[float], seconds: Sequence[float], *, n: int = 2
) -> tuple[float, float]:
    """Least-squares (alpha, bandwidth) of the ring model ``2(n-1) a + 2(n-1)/n * bytes / bw``.

    Latency is clamped at 0 and bandwidth to a positive value so a noisy fit stays usable.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2 or n < 2:
        raise ValueError("need at least two (size, seconds) pairs and n >= 2")
    xs = [2 * (n - 1) / n * s for s in sizes]
    m = len(xs)
    mx, my = sum(xs) / m, sum(seconds) / m
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("sizes must differ")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds, strict=True)) / sxx
    slope = max(slope, 1e-15)
    intercept = my - slope * mx
    return max(intercept, 0.0) / (2 * (n - 1)), 1.0 / slope
