"""Where a rank's step time goes: named, non-overlapping spans, summed per step."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Sums wall time per phase. Spans must not nest: each second is counted once.

    On GPUs a span synchronises the device at its ends so kernel time lands in the right phase;
    timing therefore costs a little throughput and is meant for benchmarks and profiling steps.
    """

    def __init__(self, *, synchronize: bool = False) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._sync = synchronize and torch.cuda.is_available()

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        if self._sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.totals[phase] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The totals since the last call, and start over."""
        out = dict(self.totals)
        self.totals.clear()
        return out


class ActivationMeter:
    """Bytes that encoder forwards keep for their backward, live and at peak.

    Counted through ``saved_tensors_hooks`` (each storage once per encoder micro-batch), which is
    exactly the activation memory the on-demand insertion policy is meant to bound.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._by_key: dict[object, int] = {}

    @contextmanager
    def recording(self, key: object) -> Iterator[None]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        size = sum(seen.values())
        self._by_key[key] = self._by_key.get(key, 0) + size
        self.live += size
        self.peak = max(self.peak, self.live)

    def release(self, key: object) -> None:
        self.live -= self._by_key.pop(key, 0)

    def take_peak(self) -> int:
        """Peak since the last call (then the peak restarts from what is live now)."""
        peak, self.peak = self.peak, self.live
        return peak
