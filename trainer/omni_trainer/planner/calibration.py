"""CPU calibration: a planner device for one trainer process on this machine, from measured figures.

``omni train --nproc W`` on a CPU runs W processes on the machine's C cores; torchrun gives each
one OpenMP thread, a single process keeps torch's default (one thread per core). A process is a
"device" whose matmul rate is the rate measured at the model's own GEMM shapes with that many
threads, while as many such processes as have a core of their own run the same benchmark at the
same time (so shared caches, memory bandwidth and clock are those of the run), divided by the
oversubscription when processes outnumber cores (4 processes on 2 cores share them: each gets
half a core). Gloo all-reduce is an alpha-beta link fitted to timed all-reduces. Work the FLOP
model does not see (Python dispatch, norms, data loading per micro-batch; clip and optimizer per
step) is a measured overhead, stretched by the same oversubscription.

Pure helpers (no torch): the measurements come from ``bench/calibrate.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omni_trainer.costs.devices import DeviceProfile, Link, all_reduce_time, cpu_profile

__all__ = [
    "SMALL_COLLECTIVES_PER_STEP",
    "CpuOverheads",
    "CpuRates",
    "concurrent_processes",
    "cpu_rank_profile",
    "fit_all_reduce_link",
    "fit_overheads",
    "oversubscription",
    "predicted_step_time",
    "threads_per_rank",
]

SMALL_COLLECTIVES_PER_STEP = 3
"""Latency-bound all-reduces of a data-parallel CPU step besides the gradients: tokens/FLOPs
and the sample fingerprint in ``components.run_summary.global_work``, the loss in
``components.step_runner.StepRunner.forward_backward``. Each costs ``2 (W - 1)`` link
latencies."""


@dataclass(frozen=True, kw_only=True)
class CpuRates:
    """FLOP/s of one trainer process at the model's shapes, measured next to a run."""

    threads: int
    """OpenMP threads of the measuring process (the trainer's: :func:`threads_per_rank`)."""
    processes: int
    """Processes that measured at the same time (:func:`concurrent_processes`)."""
    gemm_flops: float
    """Forward + both backward GEMMs of every model shape."""
    attention_flops: float
    """Causal attention forward + backward, FLOPs counted as the planner counts them."""

    def __post_init__(self) -> None:
        if self.threads < 1 or self.processes < 1:
            raise ValueError("threads and processes must be >= 1")
        if self.gemm_flops <= 0 or self.attention_flops <= 0:
            raise ValueError("measured rates must be positive")


@dataclass(frozen=True, kw_only=True)
class CpuOverheads:
    """CPU seconds the FLOP model does not count, per process with a core of its own."""

    per_microbatch_s: float
    """Per micro-batch: dispatch, norms, copies, data loading and collation of its sequences."""
    per_step_s: float
    """Per step: gradient clipping and the optimizer step."""

    def __post_init__(self) -> None:
        if self.per_microbatch_s < 0 or self.per_step_s < 0:
            raise ValueError("overheads must be >= 0")


def threads_per_rank(world_size: int, cores: int) -> int:
    """OpenMP threads of each process: torchrun sets 1; a lone process uses every core."""
    return max(cores, 1) if world_size == 1 else 1


def concurrent_processes(world_size: int, cores: int) -> int:
    """Processes that measure the rates at once: as many trainer processes as get a core each."""
    return 1 if world_size == 1 else min(world_size, max(cores, 1))


def oversubscription(world_size: int, cores: int) -> float:
    """How much slower each process runs because runnable threads outnumber cores (>= 1)."""
    busy = world_size * threads_per_rank(world_size, cores)
    return max(1.0, busy / max(cores, 1))


def cpu_rank_profile(
    rates: CpuRates, *, world_size: int, cores: int, link: Link, memory_bytes: float
) -> DeviceProfile:
    """The planner device of one process of a ``world_size``-process CPU job.

    The GEMM rate, over the oversubscription, is the peak (efficiency 1: it was measured at the
    model's shapes); attention's efficiency is its measured rate over the GEMM rate.

    A lone process (``world_size`` 1) may run any thread count (``OMP_NUM_THREADS``).

    Raises:
        ValueError: ``rates`` were measured with another thread count than the job's processes.
    """
    if world_size > 1 and rates.threads != threads_per_rank(world_size, cores):
        raise ValueError(
            f"rates measured with {rates.threads} threads; a world-{world_size} process on "
            f"{cores} cores runs {threads_per_rank(world_size, cores)}"
        )
    return cpu_profile(
        rates.gemm_flops / oversubscription(world_size, cores),
        memory_bytes=memory_bytes,
        cores=max(world_size, 1),  # every rank on one "node": gloo over loopback
        alpha_s=link.alpha_s,
        bandwidth=link.bandwidth,
        gemm_efficiency=1.0,
        attention_efficiency=min(1.0, rates.attention_flops / rates.gemm_flops),
    )


def fit_overheads(
    *, measured_s: float, simulated_s: float, per_step_s: float, microbatches: int
) -> CpuOverheads:
    """Overheads of a single-process run: the step's clip + optimizer time is measured directly
    (``per_step_s``); what the simulator leaves of the measured step is spread per micro-batch."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    left = measured_s - simulated_s - per_step_s
    return CpuOverheads(per_microbatch_s=max(0.0, left / microbatches), per_step_s=per_step_s)


def predicted_step_time(
    simulated_s: float,
    overheads: CpuOverheads,
    *,
    world_size: int,
    cores: int,
    microbatches_per_rank: int,
    link: Link,
) -> float:
    """Simulator step time (compute at the rank's rate + gradient sync) plus the overheads
    stretched by oversubscription, plus the step's latency-bound collectives."""
    over = overheads.per_step_s + overheads.per_microbatch_s * microbatches_per_rank
    small = SMALL_COLLECTIVES_PER_STEP * all_reduce_time(8, world_size, link)
    return simulated_s + over * oversubscription(world_size, cores) + small


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
