"""The CPU compatibility layer for megatron-core: the one place that bends it to run without CUDA.

megatron-core assumes CUDA in a few spots that are irrelevant to the math. On a machine without
CUDA we patch exactly those spots; where CUDA is available nothing is touched, so production GPU
paths never depend on this module. Measured needs (shared/ENVIRONMENT.md):

- ``torch.cuda.current_device()`` is used to place rotary-embedding buffers: answer the CPU.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply_cpu_compat() -> bool:
    """Patch megatron-core's CUDA assumptions when CUDA is absent. Returns whether it patched."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if not _APPLIED:
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        _APPLIED = True
    return True
