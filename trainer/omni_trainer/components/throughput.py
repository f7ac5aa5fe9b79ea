"""The peak FLOP/s that MFU is measured against: datasheet on known GPUs, measured elsewhere.

A CPU's measured rate is kept in a per-machine cache (``peak-flops.json`` in
``$OMNI_CACHE_DIR``, else ``$XDG_CACHE_HOME/megascale-omni``, else ``~/.cache/megascale-omni``),
keyed by CPU model, core count, dtype and torch version: a run starts ~2 s sooner, and every run
on the machine divides by the same figure.
Delete the file to measure again; a cache that cannot be read or written is measured around.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

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
    measured = torch.zeros(2, dtype=torch.float64)  # the rate, 1.0 when it came from the cache
    if not dist.is_initialized() or dist.get_rank() == 0:
        rate, cached = cpu_matmul_flops(dtype)
        measured[0], measured[1] = rate, float(cached)
    if dist.is_initialized():
        comm.broadcast(measured, src=0)
    source = f"measured {column} matmul, whole CPU" + (" (cached)" if measured[1] else "")
    return float(measured[0].item()), source


def peak_cache_path() -> Path:
    """Where a CPU's measured matmul rate is kept (see the module docstring)."""
    if os.environ.get("OMNI_CACHE_DIR"):
        return Path(os.environ["OMNI_CACHE_DIR"]) / "peak-flops.json"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "megascale-omni" / "peak-flops.json"


def _cpu_key(dtype: torch.dtype) -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cores | {dtype} | torch {torch.__version__}"


def cpu_matmul_flops(
    dtype: torch.dtype,
    *,
    measure: Callable[[torch.device, torch.dtype], float] | None = None,
    path: Path | None = None,
) -> tuple[float, bool]:
    """This machine's matmul FLOP/s in ``dtype`` with all its cores, from the cache or measured
    (and cached); True when it came from the cache."""
    path = path or peak_cache_path()
    key = _cpu_key(dtype)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries = entries if isinstance(entries, dict) else {}
    cached = entries.get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached), True
    rate = (measure or measure_matmul_flops)(torch.device("cpu"), dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**entries, key: rate}, indent=1) + "\n")
        tmp.replace(path)  # atomic: a run beside this one reads the old file or the new
    except OSError:
        pass  # a read-only home (a locked-down pod): measured every start, as before
    return rate, False
