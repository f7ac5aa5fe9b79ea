"""The CPU compatibility layer for megatron-core: the one place that bends it to run without CUDA.

megatron-core assumes CUDA in a few spots that are irrelevant to the math. On a machine without
CUDA we patch exactly those spots; where CUDA is available nothing is touched, so production GPU
paths never depend on this module. Measured needs (megatron-core
0.16.1, torch 2.13 on CPU):

- ``torch.cuda.current_device()`` places rotary buffers and p2p shape tensors: answer the CPU.
- ``torch.cuda.synchronize()`` after p2p ops: nothing to wait for on the CPU.
- ``LanguageModule.setup_embeddings_and_output_layer`` moves a tied embedding to CUDA before
  all-reducing it between the first and last pipeline stage: there, ``Tensor.cuda`` stays put.
- ``schedules.py`` allocates its token counter with ``torch.zeros(..., device="cuda")``: the
  module sees a ``torch`` whose ``zeros`` maps that device to the CPU (only inside schedules.py).

- Activation recompute (``tensor_parallel.checkpoint``, read against megatron-core 0.16.1)
  saves and restores the CUDA RNG state around the recomputed forward: on the CPU there is no
  device generator, so the device state is the CPU one to save and nothing to restore (the CPU
  state itself is restored by megatron's own ``torch.set_rng_state``; dropout is zero anyway).

Pipeline schedules must also run with ``batch_p2p_comm=False`` on gloo: with virtual pipelining,
batched p2p gives silently wrong gradients there (measured); ``models/llm.py``
sets ``batch_p2p_comm=False``.
"""

from __future__ import annotations

import types

import torch

_APPLIED = False


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by megatron's schedules: identical except that "cuda" tensors are CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def apply_cpu_compat() -> bool:
    """Patch megatron-core's CUDA assumptions when CUDA is absent. Returns whether it patched."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if not _APPLIED:
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import random

        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        schedules.torch = _CpuTorch()
        random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        random._set_cuda_rng_state = lambda *args, **kwargs: None
        _keep_tied_embeddings_on_cpu()
        _APPLIED = True
    return True


def _keep_tied_embeddings_on_cpu() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t  # type: ignore[method-assign]
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu
