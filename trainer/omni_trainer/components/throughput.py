"""The peak FLOP/s that MFU is measured against: datasheet on GPUs, measured on a CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from omni_trainer.components.flops import detect_peak_flops, matmul_flops, measure_peak_flops
from omni_trainer.distributed import comm


def measure_cpu_peak_flops(n: int = 2048) -> float:
    """fp32 matmul FLOP/s of this machine with all its cores (no datasheet exists for a CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        return measure_peak_flops(lambda: a @ b, flops_per_call=matmul_flops(n, n, n), iters=5)
    finally:
        torch.set_num_threads(threads)


def resolve_peak_flops(
    device: torch.device, *, world_size: int, override_per_device: float | None
) -> tuple[float, str]:
    """The job's peak FLOP/s and its source.

    GPUs: datasheet (or configured) peak per device x world size. CPU: every local rank shares one
    machine, so the peak is the machine's measured fp32 matmul rate (or the configured figure),
    measured on rank 0 and broadcast so all ranks report the same MFU.
    """
    if device.type == "cuda":
        per_device, source = detect_peak_flops(
            torch.cuda.get_device_name(device), override=override_per_device
        )
        return per_device * world_size, f"{source} x {world_size} devices"
    if override_per_device is not None:
        return float(override_per_device), "configured (machine)"
    measured = torch.zeros(1, dtype=torch.float64)
    if not dist.is_initialized() or dist.get_rank() == 0:
        measured[0] = measure_cpu_peak_flops()
    if dist.is_initialized():
        comm.broadcast(measured, src=0)
    return float(measured.item()), "measured fp32 matmul, whole CPU"
