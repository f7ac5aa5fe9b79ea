"""The peak FLOP/s that MFU is measured against: datasheet on known GPUs, measured elsewhere."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from omni_trainer.costs.flops import detect_peak_flops, matmul_flops, measure_peak_flops
from omni_trainer.distributed import comm

MATMUL_SIZES = (256, 512, 1024, 2048)
"""Square matmul sizes tried, smallest first, until one call takes :data:`MATMUL_SECONDS`."""
MATMUL_SECONDS = 0.05
"""Long enough for a stable timing; a CPU without bf16 units (0.3-1 GFLOP/s: one 2048 matmul
takes a minute) stops at a small size instead of stalling the start."""


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Matmul FLOP/s of ``device`` in ``dtype`` (a CPU with all its cores), fastest of 5 calls at
    the first size of :data:`MATMUL_SIZES` whose one call takes :data:`MATMUL_SECONDS`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)

    def matmul(n: int) -> Callable[[], None]:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)

        def run() -> None:
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return run

    try:
        for n in MATMUL_SIZES:
            run, flops = matmul(n), matmul_flops(n, n, n)
            probe = measure_peak_flops(run, flops_per_call=flops, iters=1)  # warm-up + one call
            if flops / probe >= MATMUL_SECONDS:
                break
        return measure_peak_flops(run, flops_per_call=flops, iters=5, warmup=0)
    finally:
        torch.set_num_threads(threads)


def resolve_peak_flops(
    device: torch.device,
    *,
    dtype: torch.dtype,
    world_size: int,
    override_per_device: float | None,
) -> tuple[float, str]:
    """The job's peak FLOP/s in the precision it computes in, and its source.

    GPUs: the datasheet (or configured) peak per device x world size; a GPU the table does not
    know warns and uses its measured matmul rate. CPU: every local rank shares one machine, so the
    peak is the machine's measured matmul rate (or the configured figure), measured on rank 0 and
    broadcast so all ranks report the same MFU.
    """
    column = "bf16" if dtype == torch.bfloat16 else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = detect_peak_flops(name, dtype=column, override=override_per_device)
        if found is None:
            warnings.warn(
                f"no datasheet peak FLOPs for {name!r}: MFU uses its measured {column} matmul "
                "rate; set spec.trainer.train.peakFlopsPerDevice for a datasheet figure",
                stacklevel=2,
            )
            found = measure_matmul_flops(device, dtype), f"measured {column} matmul"
        per_device, source = found
        return per_device * world_size, f"{source} x {world_size} devices"
    if override_per_device is not None:
        return float(override_per_device), "configured (machine)"
    measured = torch.zeros(1, dtype=torch.float64)
    if not dist.is_initialized() or dist.get_rank() == 0:
        measured[0] = measure_matmul_flops(device, dtype)
    if dist.is_initialized():
        comm.broadcast(measured, src=0)
    return float(measured.item()), f"measured {column} matmul, whole CPU"
