"""Memory figures of a rank: weights, gradients, optimizer state and the activation peak.

The activation peak is measured, not modelled: every tensor autograd saves for the backward (in
the LLM schedule, recomputed forwards included) is counted from the moment it is saved until
autograd frees it, each storage once, parameters excluded. That is the memory activation
recompute trades for compute, on any device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class _Saved:
    """A saved tensor; its bytes stay counted until autograd drops this holder."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._drop(self.key)


class SavedActivationMeter:
    """Live and peak bytes of the activations saved for the backward inside :meth:`recording`."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return t
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, key, self)

    def _drop(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def take_peak(self) -> int:
        """Peak since the last call (then the peak restarts from what is live now)."""
        peak, self.peak = self.peak, self.live
        return peak


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (Adam moments, steps)."""
    return tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )
