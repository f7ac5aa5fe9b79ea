"""Device and network profiles for the planner: how fast a GPU computes and how fast ranks talk.

Everything here is a default to be replaced by measurement: peak figures come from datasheets,
efficiencies (achieved / peak) from public benchmarks, and link figures from vendor specs. Each
number carries its source next to it, so a prediction can be traced to an assumption.

Pure Python (no torch): ``omni plan`` runs it on a laptop.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from omni_trainer.costs.flops import DEVICE_PEAK_FLOPS

__all__ = [
    "A100",
    "GH200",
    "H100",
    "H200",
    "PROFILES",
    "DeviceProfile",
    "EfficiencyTable",
    "Link",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "cpu_profile",
    "p2p_time",
    "reduce_scatter_time",
]

GiB = 1 << 30

OpKind = Literal["gemm", "attention"]


@dataclass(frozen=True, kw_only=True)
class EfficiencyTable:
    """Achieved / peak FLOP/s by op kind and size; a measured table replaces it wholesale.

    GEMM efficiency depends on the matmul's per-GPU width (the smaller of its N and K dimensions,
    approximated by ``hidden / sqrt(tp)``): narrow matmuls cannot fill the tensor cores. It is
    interpolated log-linearly between the points of ``gemm`` and clamped at its ends.
    """

    gemm: tuple[tuple[int, float], ...] = (
        (256, 0.25),
        (512, 0.40),
        (1024, 0.55),
        (2048, 0.64),
        (4096, 0.70),
        (8192, 0.74),
    )
    """(per-GPU GEMM width, achieved/peak). Large BF16 GEMMs reach ~700-750 TFLOP/s on H100 SXM
    (about 0.7-0.75 of 989; NVIDIA cuBLAS / Transformer Engine benchmark figures, and the
    "Matrix Multiplication Background" guide shows efficiency falling with narrow dimensions).
    Widths below 2048 are our extrapolation of that curve, not a measurement."""
    attention: float = 0.35
    """FlashAttention-2 on H100 reaches ~35% of peak (Shah et al. 2024, FlashAttention-3,
    arXiv:2407.08608, Sec. 1: "FlashAttention-2 achieves only 35% utilization on H100")."""
    overhead: float = 1.10
    """Multiplier on compute time for the ops FLOPs do not count (norms, activations, rotary,
    casts, optimizer step): our assumption, ~10%."""

    def __post_init__(self) -> None:
        if not self.gemm or any(not 0 < e <= 1 for _, e in self.gemm):
            raise ValueError(f"gemm efficiencies must be in (0, 1], got {self.gemm}")
        if not 0 < self.attention <= 1:
            raise ValueError(f"attention efficiency must be in (0, 1], got {self.attention}")
        if self.overhead < 1:
            raise ValueError(f"overhead must be >= 1, got {self.overhead}")

    def gemm_efficiency(self, width: float) -> float:
        """Achieved/peak of a GEMM of that per-GPU width (log-linear between table points)."""
        xs = [w for w, _ in self.gemm]
        ys = [e for _, e in self.gemm]
        if width <= xs[0]:
            return ys[0]
        if width >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, width)
        lo, hi = math.log(xs[i - 1]), math.log(xs[i])
        t = (math.log(width) - lo) / (hi - lo)
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass(frozen=True, kw_only=True)
class Link:
    """One hop in the alpha-beta model: ``alpha + bytes / bandwidth`` per message (per GPU)."""

    name: str
    alpha_s: float
    """Latency per message / ring step, seconds."""
    bandwidth: float
    """Achievable bytes/s per GPU per direction (spec x efficiency)."""

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` once over this link."""
        return self.alpha_s + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One accelerator type and the network around it."""

    name: str
    peak_flops: float
    """Dense BF16 (or fp32 for CPU) FLOP/s the MFU divides by."""
    hbm_bytes: float
    """Memory per device."""
    gpus_per_node: int
    intra: Link
    """Link between devices of one node (NVLink)."""
    inter: Link
    """Link between nodes (IB/RoCE), per device (one rail NIC per GPU)."""
    host: Link | None = None
    """Host <-> device link (PCIe or NVLink-C2C) per device and direction, for activation
    offload; ``None`` where the "device" is the host (CPU profiles), so nothing can be
    offloaded."""
    efficiency: EfficiencyTable = field(default_factory=EfficiencyTable)
    reserved_bytes: float = 4 * GiB
    """Memory the framework takes besides tensors (CUDA context, NCCL buffers, allocator
    fragmentation): our assumption, ~4 GiB on an 80 GB GPU."""
    grad_bytes: int = 2
    """Bytes per gradient element in the data-parallel sync: bf16 on GPUs; 4 on a CPU, where the
    trainer runs in fp32."""

    def compute_time(self, flops: float, kind: OpKind = "gemm", *, width: float = 8192) -> float:
        """Seconds for ``flops`` of one op kind on one device (overhead included)."""
        if flops <= 0:
            return 0.0
        eff = (
            self.efficiency.attention
            if kind == "attention"
            else self.efficiency.gemm_efficiency(width)
        )
        return flops * self.efficiency.overhead / (self.peak_flops * eff)

    def link(self, group_size: int, *, spans_nodes: bool | None = None) -> Link:
        """The link a group of that size uses: NVLink if it fits in a node, else the network."""
        if spans_nodes is None:
            spans_nodes = group_size > self.gpus_per_node
        return self.inter if spans_nodes else self.intra


# Links. H100 SXM NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction (H100
# datasheet); NCCL all-reduce bus bandwidth on DGX H100 is ~80% of it (nccl-tests figures),
# hence 360 GB/s. Inter-node: DGX H100 has 8 x 400 Gb/s ConnectX-7 (one per GPU, rail-optimised)
# = 50 GB/s per GPU per direction; ~80% achievable -> 40 GB/s. Latencies: single-digit us per
# NVLink ring step, ~10 us across IB (our round figures).
_NVLINK_H100 = Link(name="NVLink4", alpha_s=5e-6, bandwidth=360e9)
_IB_NDR = Link(name="IB NDR 400G/GPU", alpha_s=10e-6, bandwidth=40e9)
# A100 SXM NVLink 3: 600 GB/s bidirectional = 300 per direction; DGX A100: 8 x 200 Gb/s HDR.
_NVLINK_A100 = Link(name="NVLink3", alpha_s=5e-6, bandwidth=240e9)
_IB_HDR = Link(name="IB HDR 200G/GPU", alpha_s=10e-6, bandwidth=20e9)
# Host links (activation offload), per GPU per direction, at 80% of spec (our assumption, the
# same factor as the network links above; not measured). PCIe Gen5 x16: 32 GT/s x 16 lanes
# ~64 GB/s per direction (H100 SXM and H200 datasheets: "PCIe Gen5: 128 GB/s", bidirectional)
# -> 51.2 GB/s; PCIe Gen4 x16 ~32 GB/s per direction (A100 datasheet: "PCIe Gen4: 64 GB/s")
# -> 25.6 GB/s; GH200 NVLink-C2C 900 GB/s bidirectional = 450 per direction (GH200 datasheet)
# -> 360 GB/s. Each GPU is assumed to own its x16 link (DGX/HGX boards put two GPUs and NICs
# behind one PCIe switch, so offload can contend with GPUDirect RDMA: not modelled). Latency:
# ~10 us per copy (launch + link; our round figure).
_PCIE5 = Link(name="PCIe Gen5 x16", alpha_s=10e-6, bandwidth=0.8 * 64e9)
_PCIE4 = Link(name="PCIe Gen4 x16", alpha_s=10e-6, bandwidth=0.8 * 32e9)
_NVLINK_C2C = Link(name="NVLink-C2C", alpha_s=10e-6, bandwidth=0.8 * 450e9)

H100 = DeviceProfile(
    name="H100 SXM 80GB",
    peak_flops=DEVICE_PEAK_FLOPS["H100 SXM"],  # 989e12 dense BF16 (datasheet)
    hbm_bytes=80e9,
    gpus_per_node=8,
    intra=_NVLINK_H100,
    inter=_IB_NDR,
    host=_PCIE5,
)
# HGX H200: the H100 board with 141 GB HBM3e; the host link is still PCIe Gen5.
H200 = replace(H100, name="H200 141GB", peak_flops=DEVICE_PEAK_FLOPS["H200 SXM"], hbm_bytes=141e9)
# GH200 Grace Hopper (144 GB HBM3e variant): same tensor cores as H100/H200 (989 TFLOP/s dense
# BF16, datasheet), host memory behind NVLink-C2C. Node and network are taken from the HGX
# profile (8 per node, one 400G rail NIC each): our assumption, GH200 systems vary.
GH200 = replace(H200, name="GH200 144GB", hbm_bytes=144e9, host=_NVLINK_C2C)
A100 = DeviceProfile(
    name="A100 SXM 80GB",
    peak_flops=DEVICE_PEAK_FLOPS["A100 80GB"],  # 312e12 dense BF16 (datasheet)
    hbm_bytes=80e9,
    gpus_per_node=8,
    intra=_NVLINK_A100,
    inter=_IB_HDR,
    host=_PCIE4,
    # A100's narrower tensor cores saturate at smaller widths; same curve kept (not measured).
)
PROFILES: dict[str, DeviceProfile] = {"H100": H100, "H200": H200, "GH200": GH200, "A100": A100}


def cpu_profile(
    peak_flops: float,
    *,
    memory_bytes: float = 64 * GiB,
    cores: int = 1,
    alpha_s: float = 50e-6,
    bandwidth: float = 2e9,
    gemm_efficiency: float = 1.0,
    attention_efficiency: float = 0.5,
) -> DeviceProfile:
    """A CPU "device" (one process = one rank, gloo over shared memory) from a measured peak.

    Args:
        peak_flops: fp32 FLOP/s of one rank, measured elsewhere (``measure_peak_flops``).
        memory_bytes: memory available to all ranks of the machine.
        cores: ranks that fit one "node" (all ranks share the machine).
        alpha_s, bandwidth: gloo message latency and bytes/s (defaults: rough figures).
        gemm_efficiency: achieved/peak of model GEMMs; 1.0 when the peak was measured with
            matmuls of similar size.
        attention_efficiency: achieved/peak of attention (unfused on CPU).
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    link = Link(name="gloo shm", alpha_s=alpha_s, bandwidth=bandwidth)
    return DeviceProfile(
        name="CPU",
        peak_flops=peak_flops,
        hbm_bytes=memory_bytes,
        gpus_per_node=max(cores, 1),
        intra=link,
        inter=link,
        efficiency=EfficiencyTable(
            gemm=((1, gemm_efficiency),), attention=attention_efficiency, overhead=1.0
        ),
        reserved_bytes=0.0,
        grad_bytes=4,
    )


# --------------------------------------------------------------------------------------------
# Collectives (ring algorithms, alpha-beta; Thakur, Rabenseifner & Gropp 2005; NCCL's busbw).
# ``nbytes`` is the full buffer (all-reduce, all-gather output, reduce-scatter input) or, for
# all-to-all, what one rank holds before the exchange.


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: ``2 (n-1)`` steps moving ``nbytes / n`` each."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.bandwidth


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of a buffer of ``nbytes`` in total: ``n - 1`` steps of ``nbytes / n``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter: the mirror of all-gather, same cost."""
    return all_gather_time(nbytes, n, link)


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Pairwise all-to-all: each rank keeps ``1/n`` and sends ``(n-1)/n`` of its ``nbytes``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bandwidth


def p2p_time(nbytes: float, link: Link) -> float:
    """One send/receive."""
    return link.time(nbytes)
